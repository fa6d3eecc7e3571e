"""docs/transformers.md runs as written: its python snippets, in order, in one namespace, the
cluster one against a real local cluster (the address it names is replaced by the cluster's);
docs/models.md lists every row of the family table with the outcome the tests pin."""

from __future__ import annotations

import re
from pathlib import Path

from hf_families import FAMILIES

from pagedkv.cluster import LocalCluster, NodeOptions

DOCS = Path(__file__).resolve().parents[2] / "docs"
SNIPPET = re.compile(r"```python\n(.*?)```", re.S)
PLACEHOLDER = "127.0.0.1:50051"


def test_the_transformers_guide_runs_as_written(tmp_path):
    text = (DOCS / "transformers.md").read_text()
    snippets = SNIPPET.findall(text)
    assert len(snippets) >= 8
    assert sum(PLACEHOLDER in s for s in snippets) == 1
    options = NodeOptions(num_blocks=256, host_blocks=0)  # `pagedkv up`'s default shape
    with LocalCluster(1, options, log_dir=str(tmp_path)) as cluster:
        namespace: dict = {}
        for i, code in enumerate(snippets):
            code = code.replace(PLACEHOLDER, cluster.coordinator_address)
            exec(compile(code, f"docs/transformers.md snippet {i}", "exec"), namespace)  # noqa: S102


def test_the_models_page_lists_every_family_row_with_its_outcome():
    text = (DOCS / "models.md").read_text()
    listed = dict(re.findall(r"`([a-z0-9-]+)` ([✓✗])", text))
    for family in FAMILIES:
        assert family.name in listed, f"docs/models.md does not list {family.name}"
        assert (listed[family.name] == "✓") == family.is_exact, family.name
    assert set(listed) == {f.name for f in FAMILIES}
