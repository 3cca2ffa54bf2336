"""The `attn-core` command: its subcommands, argument types, shared verdicts and progress lines."""
