"""Package metadata: the version users see is the one installed."""
import importlib.metadata

import ddtree_sglang


def test_version_and_project_urls():
    assert ddtree_sglang.__version__ == importlib.metadata.version("ddtree-sglang")
    urls = importlib.metadata.metadata("ddtree-sglang").get_all("Project-URL")
    assert any(u.startswith("Paper, https://") for u in urls)
