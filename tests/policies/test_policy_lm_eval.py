"""lm-evaluation-harness over a patched model: ``kvkit.patched`` + lm_eval's ``HFLM`` on a local task file (no hub).

Skipped where ``lm_eval`` is not importable (it is not a kvkit dependency), unless ``KVKIT_REQUIRE_LM_EVAL`` is set:
CI installs the harness after the main suite and runs this file with it set (``.ci/run``), so there a broken
install fails instead of skipping."""

import json
import os

import pytest
import torch

import kvkit
from kvkit.testing import tiny_model

if os.environ.get("KVKIT_REQUIRE_LM_EVAL"):
    import lm_eval  # noqa: F401
else:
    lm_eval = pytest.importorskip("lm_eval")

TASK = """\
task: kvkit_local_copy
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{context}}}}\\nAnswer:"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 4
  do_sample: false
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
"""


@pytest.fixture
def task_dir(tmp_path):
    data = tmp_path / "copy.jsonl"
    with data.open("w") as f:
        for i in range(3):
            f.write(json.dumps({"context": f"The code is {1000 + i}. " * 20 + "What is the code?",
                                "answer": f" {1000 + i}"}) + "\n")
    (tmp_path / "kvkit_local_copy.yaml").write_text(TASK.format(data=data))
    return tmp_path


def test_lm_eval_runs_a_local_task_on_a_patched_model_and_the_model_is_restored(task_dir, monkeypatch):
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    from kvkit.models import load_tokenizer

    tok = load_tokenizer("default")
    model = tiny_model("llama", vocab_size=len(tok), max_position_embeddings=4096)
    caches = []
    init = kvkit.KVCache.__init__

    def counting_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        caches.append(self.policy.name)

    monkeypatch.setattr(kvkit.KVCache, "__init__", counting_init)
    with kvkit.patched(model, "streaming", compression_ratio=0.5):
        lm = HFLM(pretrained=model, tokenizer=tok, batch_size=1, device="cpu")
        out = simple_evaluate(model=lm, tasks=["kvkit_local_copy"], task_manager=TaskManager(include_path=str(task_dir)),
                              limit=3)
    assert "exact_match,none" in out["results"]["kvkit_local_copy"]
    assert caches and set(caches) == {"streaming"}  # generation ran on kvkit's compressed cache
    assert kvkit.patched_policy(model) is None
    with torch.no_grad():
        assert model(input_ids=torch.tensor([[1, 2, 3]])).logits.shape[-1] == len(tok)
