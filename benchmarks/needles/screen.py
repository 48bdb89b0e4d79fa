r"""Screen policy settings on chosen fresh needles, without a run folder.

    python benchmarks/needles/screen.py heldout 1,2,3,7,9,13,15 'ship=tidal:budget=2048,selection=q_head' \
        'shared1169=tidal:budget=1169,selection=shared,select_layers=[2,6,10,14,18,22,26]'

``heldout``: the set of ``results/needles/heldout-squad-4k-agnostic`` (SQuAD haystack, seed 7919, digits and UUIDs);
``essay``: the set of ``results/needles/default-4k-agnostic`` (33 needles, the default seed). The indices pick samples
(4,096 tokens, question-agnostic: the context prefilled and compressed before the question, as ``kvkit eval
needles``). Each ``NAME=POLICY[:KEY=VALUE,...]`` runs on the default model; prints each answer, its score and a total.
Run one process per setting, at one thread each.
"""

import sys
import time

import torch

import kvkit
from kvkit import models
from kvkit.evals import needles, ruler
from kvkit.evals.generation import encode, generate
from kvkit.options import parse_options

SETS = {"heldout": dict(seed=7919, formats=["digits", "uuid"], haystack="squad", n=16),
        "essay": dict(seed=needles.DEFAULT_SEED, formats=list(needles.FORMATS), haystack="essay", n=33)}


def set_samples(tok, name: str) -> list[dict]:
    """The 4,096-token samples of set ``name`` (:data:`SETS`), as ``kvkit eval needles`` made them."""
    st = SETS[name]
    return needles.generate_samples(tok, [4096], st["n"], seed=st["seed"], formats=st["formats"],
                                    haystack=st["haystack"])


def split_sample(tok, s: dict) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """Sample ``s`` for teacher forcing: ``(context ids [1, S], question + answer prefix ids [1, R], the reference
    answer's ids)``, the context and the rest encoded apart as the question-agnostic protocol feeds them."""
    ctx = encode(tok, s["prompt"][: s["context_end"]])
    rest = encode(tok, s["prompt"][s["context_end"]:])
    return ctx, rest, tok(" " + s["outputs"][0], add_special_tokens=False)["input_ids"]


def main(argv: list[str]) -> None:
    if len(argv) < 3 or argv[0] not in SETS:
        raise SystemExit(__doc__)
    idx = [int(x) for x in argv[1].split(",")]
    torch.set_num_threads(1)
    model, tok = models.load("default")
    samples = set_samples(tok, argv[0])
    for spec in argv[2:]:
        name, _, rest = spec.partition("=")
        policy, _, opts = rest.partition(":")
        kvkit.patch(model, policy, **(parse_options([opts]) if opts else {}))
        total = 0.0
        for i in idx:
            s = samples[i]
            t0 = time.time()
            g = generate(model, tok, s["prompt"], s["tokens_to_generate"], s.get("context_end"))
            sc = ruler.score(s["metric"], g.text, s["outputs"])
            total += sc
            print(f"{name} {i} {sc:.0f} {g.text[:45]!r} ref={s['outputs']} {time.time() - t0:.0f}s", flush=True)
        print(f"== {name}: {total:.0f}/{len(idx)}", flush=True)
        kvkit.unpatch(model)


if __name__ == "__main__":
    main(sys.argv[1:])
