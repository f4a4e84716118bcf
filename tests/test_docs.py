"""The docs run as written: every ```python block of docs/passes.md executes, in order, in one
namespace (each example checks its own result)."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BLOCK = re.compile(r"^```python\n(.*?)^```", re.M | re.S)


def _blocks(doc):
    return BLOCK.findall((ROOT / doc).read_text())


def test_passes_doc_examples_run(capsys):
    blocks = _blocks("docs/passes.md")
    assert len(blocks) == 5, "setup, op swap, its naive twin, checkpoint region, shape print"
    namespace = {"__name__": "docs_passes"}
    for i, code in enumerate(blocks):
        exec(compile(code, f"docs/passes.md block {i}", "exec"), namespace)
    out = capsys.readouterr().out
    assert "fxsplit.verify: OK" in out
    assert "that pass 'gelu_to_tanh_naive' added has no meta[\"val\"]" in out
    assert "blocks_0_mlp_up" in out
