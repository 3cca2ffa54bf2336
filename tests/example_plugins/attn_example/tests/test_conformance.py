from attn_core.testing import ConformanceSuite


class TestExampleConformance(ConformanceSuite):
    backend = "example"
    skip = {"long-*": "example: long requests are covered by torch_native's own suite"}
