"""attn-example: the smallest useful attention-backend plugin (a test fixture of attn-core)."""
