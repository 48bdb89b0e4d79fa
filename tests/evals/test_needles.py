"""Fresh needles (kvkit.evals.needles), the QuantizedCache peer row (kvkit.evals.peers), the needle table
(kvkit.evals.needles_report) and `kvkit eval needles` end to end on a tiny model."""

import importlib.util
import json
import math
import re

import pytest
import torch

from kvkit.evals import needles, peers
from kvkit.evals.needles_report import (
    LABEL_CHAR,
    LABEL_LINE,
    LABEL_WRAP,
    _crosses,
    label_axis,
    label_spots,
    table,
    uncompressed,
    write_report,
)
from kvkit.models import load_tokenizer

HAS_QUANTO = importlib.util.find_spec("optimum") is not None and importlib.util.find_spec("optimum.quanto") is not None


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer("default")


def test_samples_fit_their_length_cycle_formats_and_depths_and_split_before_the_question(tok):
    ss = needles.generate_samples(tok, [1024, 2048], 6, depths=3)
    assert [s["task"] for s in ss[:6]] == ["digits", "uuid", "words"] * 2
    assert [s["depth"] for s in ss[:6]] == [0.0, 50.0, 100.0] * 2
    for s in ss:
        L = s["target_length"]
        assert 0.98 * L <= s["length"] <= L  # prompt + generation within 2% below the target
        ctx, rest = s["prompt"][: s["context_end"]], s["prompt"][s["context_end"]:]
        key = s["meta"]["key"]
        assert needles.NEEDLE.format(key=key, kind=needles.KIND[s["task"]], value=s["outputs"][0]) in ctx
        assert "Which" in rest and key in rest and s["outputs"][0] not in rest  # the question, not the answer
    # deterministic for a seed, different for another
    again = needles.generate_samples(tok, [1024, 2048], 6, depths=3)
    assert [s["prompt"] for s in again] == [s["prompt"] for s in ss]
    other = needles.generate_samples(tok, [1024], 2, depths=3, seed=7)
    assert other[0]["outputs"] != ss[0]["outputs"]


def test_needles_are_disjoint_from_calibration_data(tok):
    """Keys are not calibration words, the template is not the calibration's, and the essay haystack ends before
    the calibration haystacks' first word (the last third of the same essays): the knob calibrations' needles and
    DuoAttention's passkey samples both read only from there."""
    from kvkit.calibrate import needles as calib
    from kvkit.calibrate.duo_data import DuoCalibration, PasskeyData
    from kvkit.calibrate.haystack import HAYSTACK_START, calibration_text, essay_path

    ss = needles.generate_samples(tok, [2048], 9, depths=3)
    for s in ss:
        assert s["meta"]["key"] not in calib.WORDS
        assert "vault" not in s["prompt"] and "special magic" not in s["prompt"]
        assert s["meta"]["essay_offset"] + s["meta"]["words"] <= needles.essay_span()
    data = json.loads(essay_path().read_text(encoding="utf-8"))
    text = data["text"] if isinstance(data, dict) else " ".join(x.get("text", "") for x in data)
    calib_first_word = len(re.sub(r"\s+", " ", text[: int(len(text) * HAYSTACK_START)]).strip().split(" "))
    assert needles.essay_span() < calib_first_word
    later = calibration_text()
    assert text.endswith(later) and len(later) < 0.35 * len(text) and calib.essay_text() == later
    duo_hay = tok.decode(PasskeyData(tok, DuoCalibration(steps=2, length=256)).hay[:200])
    assert duo_hay.strip()[:300] in later and duo_hay.strip()[:300] not in text[: len(text) - len(later)]
    squad = needles.generate_sample(tok, 1024, 0, haystack="squad")
    assert "essay_offset" not in squad["meta"] and 0.98 * 1024 <= squad["length"] <= 1024


def test_bad_needle_arguments(tok):
    with pytest.raises(ValueError, match="format"):
        needles.generate_samples(tok, [1024], 2, formats=["digits", "hex"])
    with pytest.raises(ValueError, match="haystack"):
        needles.generate_sample(tok, 1024, 0, haystack="wiki")
    with pytest.raises(ValueError, match="too small"):
        needles.generate_sample(tok, 40, 0)
    with pytest.raises(ValueError, match="positive"):
        needles.generate_samples(tok, [1024], 0)


def test_peer_options_are_checked():
    assert peers.peer_options("quantized", {"nbits": 2})["nbits"] == 2
    with pytest.raises(ValueError, match="unknown option"):
        peers.peer_options("quantized", {"bits": 4})
    with pytest.raises(ValueError, match="backend"):
        peers.peer_options("quantized", {"backend": "bnb"})
    with pytest.raises(ValueError, match="positive"):
        peers.peer_options("quantized", {"q_group_size": 0})


@pytest.mark.skipif(not HAS_QUANTO, reason="needs optimum-quanto (the eval extra)")
def test_quantized_peer_holds_fewer_bytes_and_keeps_greedy_tokens_on_a_short_prompt():
    """The peer on a tiny model: before residual_length tokens nothing is quantized (same tokens as the plain
    cache, bytes = the exact window); past it, the 4-bit part holds fewer bytes than full precision."""
    from transformers import DynamicCache

    from kvkit.compat import cache_kw
    from kvkit.testing import random_ids, tiny_model

    model = tiny_model("llama")
    ids = random_ids(300, seed=3)
    full = DynamicCache(config=model.config)
    q = peers.make_cache(model, "quantized", {"nbits": 4, "q_group_size": 16, "residual_length": 32})
    with torch.no_grad():
        model(input_ids=ids, **cache_kw(full), use_cache=True)
        model(input_ids=ids, **cache_kw(q), use_cache=True)
    fb = peers.cache_nbytes(full)
    qb = peers.cache_nbytes(q)
    assert fb == sum(t.numel() * t.element_size() for layer in full.layers for t in (layer.keys, layer.values))
    assert 0 < qb < 0.6 * fb, (qb, fb)


def _rows(ids, scores, kv, task="digits"):
    return [dict(id=i, sample_sha=f"sha{i}", task=task, score=s, kv_bytes=k) for i, s, k in zip(ids, scores, kv)]


def test_needle_table_is_relative_to_full_on_the_same_samples():
    full = ("full", dict(policy="full", options={}), _rows([1, 2, 3, 4], [1, 1, 1, 0], [100] * 4))
    half = ("snap", dict(policy="snapkv", options={"budget": 8}), _rows([1, 2, 3, 4], [1, 0, 1, 1], [50] * 4))
    q = ("q4", dict(policy="quantized", options=peers.peer_options("quantized", {})),
         _rows([1, 2, 3, 4], [1, 1, 1, 0], [20] * 4))
    header, rows, recs = table([full, half, q])
    by = {r["run"]: r for r in recs}
    assert by["snap"]["accuracy"] == 0.75 and by["snap"]["x_full"] == 1.0
    assert by["snap"]["kept"] == pytest.approx(2 / 3) and by["snap"]["kv_fraction"] == 0.5
    assert by["q4"]["kv_fraction"] == 0.2 and "4-bit quanto" in rows[2][2]
    assert rows[1][2] == "budget=8"  # every option a run set is named
    prot = ("p", dict(policy="snapkv", options={"protect_heads": 0.2, "budget": 6}), half[2])
    assert table([full, prot])[1][1][2] == "budget=6,protect_heads=0.2"
    # the shipped pattern a duo run picked by itself is named by its content: runs before and after a recalibration
    # read apart; a pattern the run named is an option and named as such
    shipped = ("duo", dict(policy="duo", options={}, option_files={"pattern": "738e2724" + "0" * 56}), half[2])
    given = ("duo2", dict(policy="duo", options={"pattern": "p.json"}, option_files={"pattern": "ab" * 32}), half[2])
    rows_ = table([full, shipped, given])[1]
    assert rows_[1][2] == "shipped pattern 738e2724" and rows_[2][2] == "pattern=p.json"
    with pytest.raises(ValueError, match="exactly one run of policy 'full'"):
        table([half, q])
    other = ("x", dict(policy="streaming", options={}), _rows([9], [1], [1]))
    with pytest.raises(ValueError, match="not samples of the full run"):
        table([full, other])
    short = ("s", dict(policy="streaming", options={}), _rows([1, 2], [1, 0], [10, 10]))  # stopped early
    _, _, recs = table([full, half, short])
    assert [r["samples"] for r in recs] == [2, 2, 2] and recs[1]["accuracy"] == 0.5 and recs[2]["x_full"] == 0.5


def _with_reads(rows, reads):
    return [dict(r, kv_read=k) for r, k in zip(rows, reads)]


def test_needle_table_flags_a_run_that_did_not_compress(tmp_path):
    """A shadowkv run whose prompts were all at most its ``min_prompt`` held and read full's bytes: the table's
    ``reads x full`` says 1.0 and the report names it as not compressed; tidal (all bytes, fewer reads) and a run
    without read counts are not flagged."""
    full = ("full", dict(policy="full", options={}), _with_reads(_rows([1, 2], [1, 1], [100, 100]), [100, 100]))
    same = ("sk", dict(policy="shadowkv", options={"budget": 8}),
            _with_reads(_rows([1, 2], [1, 1], [100, 100]), [100, 100]))
    tidal = ("td", dict(policy="tidal", options={"budget": 8}),
             _with_reads(_rows([1, 2], [1, 0], [100, 100]), [40, 60]))
    old = ("old", dict(policy="snapkv", options={}), _rows([1, 2], [1, 1], [100, 100]))
    header, rows, recs = table([full, same, tidal, old])
    by = {r["run"]: r for r in recs}
    assert "reads x full" in header
    assert by["sk"]["read_fraction"] == 1.0 and by["td"]["read_fraction"] == 0.5 and by["old"]["read_fraction"] is None
    assert uncompressed(recs) == ["sk"]
    # a full run written before kv_read was recorded: it read what it held (its kv_bytes)
    old_full = ("full", dict(policy="full", options={}), _rows([1, 2], [1, 1], [100, 100]))
    by = {r["run"]: r for r in table([old_full, tidal, old])[2]}
    assert by["td"]["read_fraction"] == 0.5 and by["old"]["read_fraction"] is None
    for name, cfg, rows_ in (full, same, tidal):
        d = tmp_path / name
        d.mkdir()
        (d / "config.json").write_text(json.dumps(dict(cfg, model="m", protocol="agnostic")))
        (d / "samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows_))
    md = write_report(tmp_path, [tmp_path / n for n in ("full", "sk", "td")], "t")
    assert "**Did not compress**: sk held and read all of full's KV" in md and "td" not in md.split("compress**")[1]
    assert md.startswith("# t\n\nModel m; protocol")  # fp32 (no dtype recorded): the model's name alone


def test_a_root_run_in_another_dtype_says_so_in_its_title_and_table(tmp_path):
    """A root whose model ran in bf16 names the dtype in the figure's and the table's title and in the table's
    first line, so its numbers are not read as the fp32 roots' beside it."""
    from kvkit.evals.needles_report import report_title

    assert report_title("default", 4096, "agnostic", "essay") == (
        "Fresh needles: default, 4096 tokens of essay, question-agnostic")
    title = report_title("default", 4096, "agnostic", "essay", "bfloat16")
    assert title == "Fresh needles: default (bfloat16), 4096 tokens of essay, question-agnostic"
    for name, policy in (("full", "full"), ("zc", "zipcache")):
        d = tmp_path / name
        d.mkdir()
        (d / "config.json").write_text(json.dumps(dict(policy=policy, options={}, model="m", protocol="agnostic",
                                                       dtype="bfloat16")))
        (d / "samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in _rows([1, 2], [1, 1], [100, 50])))
    md = write_report(tmp_path, [tmp_path / "full", tmp_path / "zc"], title)
    assert md.startswith(f"# {title}\n\nModel m (bfloat16); protocol")


def test_figure_labels_share_a_point_and_never_overlap():
    """The accuracy-vs-bytes labels: runs at one point get one label; a crowd of points gets labels that cover no
    other label and no marker (a label is never drawn over another run's label)."""
    import math

    def rec(run, kv, x):
        return dict(run=run, kv_fraction=kv, x_full=x)

    shown = [rec("full", 1.0, 1.0), rec("chelsea-p0.2", 0.52, 0.87), rec("cake-p0.2", 0.521, 0.8705),
             rec("shadowkv-2048", 0.49, 0.826), rec("duo", 0.54, 0.826), rec("snapkv-p0.2", 0.54, 0.91),
             rec("kvzip-p0.2", 0.54, 1.0), rec("tidal-2048", 1.0, 0.78), rec("zero", 0.0, 0.5)]

    def check(shown):
        spots = label_spots(shown)
        boxes = []
        for text, (_px, py), (tx, ty), left, moved, box in spots:
            end = math.log10(tx)
            lines = text.split("\n")
            w = LABEL_CHAR * max(map(len, lines))
            x0, x1 = (end - w, end) if left else (end, end + w)
            top = ty + LABEL_LINE * (len(lines) - 1) + 0.9 * LABEL_LINE  # lines stack upwards
            assert box == pytest.approx((x0, x1, ty, top))  # the box the figure's limits hold
            assert not any(a < x1 and x0 < b and c < top and ty < d for a, b, c, d in boxes), text
            for r in shown:  # no label covers a marker
                lx, ly = math.log10(max(r["kv_fraction"], 1e-9)), r["x_full"]
                assert not (x0 < lx + 0.75 * LABEL_CHAR and lx - 0.75 * LABEL_CHAR < x1 and ty < ly + 0.015
                            and ly - 0.015 < top), (text, r["run"])
            assert moved == (ty < py)
            boxes.append((x0, x1, ty, top))
        return spots

    texts = [t for t, *_ in check(shown)]
    assert "cake-p0.2, chelsea-p0.2" in texts and len(texts) == len(shown) - 1
    # a crowd at 1.0 above chelsea-p0.2's point. chelsea's label stays beside its own
    # point (it was pushed left, and kvzip-p0.2's moved label sat beside its point instead); the moved labels'
    # leader lines cross no other
    qwen = [rec("chelsea-p0.2", 0.575, 0.917), rec("duo", 0.585, 1.0), rec("kvzip-768", 0.584, 1.0),
            rec("kvzip-p0.2", 0.571, 1.0), rec("shadowkv-1024", 0.447, 1.0), rec("shadowkv-minmax-1024", 0.501, 1.0),
            rec("kvzip-256", 0.33, 0.917), rec("zipcache-k8", 0.23, 1.0), rec("full", 1.0, 1.0)]
    spots = {t: (left, moved, (math.log10(px), py), (math.log10(tx), ty))
             for t, (px, py), (tx, ty), left, moved, _ in check(qwen)}
    assert spots["chelsea-p0.2"][:2] == (False, False)
    seg = [(*p, *q) for _left, moved, p, q in spots.values() if moved]
    assert len(seg) >= 2
    assert not any(_crosses(a, b) for i, a in enumerate(seg) for b in seg[i + 1:])
    # a crowd at one x, 0.01 apart: right, left, then a line lower with a leader line
    crowd = check([rec(f"run-{i}", 0.5, 0.8 + 0.01 * i) for i in range(4)])
    assert len(crowd) == 4 and [c[3] for c in crowd[:2]] == [False, True] and crowd[2][4] and crowd[3][4]
    # many runs at one point (the Qwen figure: full and four tidal runs at 1.0): the label wraps after a comma,
    # its lines stack, and the neighbours' labels still keep clear of it
    many = [rec(n, 1.0, 1.0) for n in ("full", "tidal-qhead-115", "tidal-1024", "tidal-shared-509", "tidal-shared-811")]
    spots = check(many + [rec("kvzip-768", 0.58, 1.0), rec("duo", 0.59, 1.0), rec("zipcache", 0.16, 1.0)])
    text = next(t for t, *_ in spots if t.startswith("full"))
    assert text.split("\n") == ["full, tidal-qhead-115,", "tidal-1024, tidal-shared-509,", "tidal-shared-811"]
    assert max(map(len, text.split("\n"))) <= LABEL_WRAP


def test_figure_axis_is_the_span_its_labels_were_sized_for():
    """Labels are measured in fractions of the axis width; the x axis label_axis returns is exactly the span they
    were measured for (so a label ends where it was placed) and holds every point and every label."""
    def rec(run, kv, x):
        return dict(run=run, kv_fraction=kv, x_full=x)

    shown = [rec("zipcache", 0.16, 1.0), rec("a-long-run-name-at-the-right-edge", 1.0, 0.8), rec("full", 1.0, 1.0),
             rec("kvzip-768", 0.58, 1.0), rec("snapkv", 0.55, 0.3)]
    lo, hi = math.log10(0.16), 0.0
    spots, x0, x1 = label_axis(shown, lo, hi)
    again = label_spots(shown, x1 - x0)  # sized for the axis it gets
    assert [s[0] for s in again] == [s[0] for s in spots]
    assert [s[5] for s in again] == [pytest.approx(s[5], abs=1e-9) for s in spots]
    assert x0 < lo and hi < x1 and all(x0 <= b[0] and b[1] <= x1 for *_, b in spots)
    assert x1 - x0 > (hi - lo) * 1.25  # widened for the long label at the right edge


def test_the_byte_axis_holds_the_tick_just_below_its_least_point():
    """A root whose least point is 0.34 of full's bytes gets its 0.3 tick on the axis (the axis span reaches it), not
    a first tick at 0.5 with the point past every mark; ticks far from every point are left off."""
    from kvkit.evals.needles_report import byte_ticks

    ticks, lo, hi = byte_ticks(0.34, 1.0)
    assert ticks == [0.3, 0.5, 0.7, 1.0]
    assert lo == pytest.approx(math.log10(0.3)) and hi == pytest.approx(0.0)
    ticks, lo, hi = byte_ticks(0.55, 1.0)
    assert ticks == [0.5, 0.7, 1.0] and lo == pytest.approx(math.log10(0.5))
    ticks, lo, hi = byte_ticks(0.16, 0.6)
    assert ticks == [0.2, 0.3, 0.5, 0.7] and lo == pytest.approx(math.log10(0.16))
    assert hi == pytest.approx(math.log10(0.7))


def test_a_root_of_many_runs_is_drawn_one_row_per_run():
    """More runs than the scatter can label (many policies at the same few byte fractions) are drawn as a dot
    chart: one row each, so the figure grows with the runs; a few runs keep the labelled scatter."""
    import io

    from PIL import Image

    from kvkit.evals.needles_report import SCATTER_MOST, figure_png

    def rec(i):
        policy = ("full", "snapkv", "cake", "duo")[i % 4]
        return dict(run=f"{policy}-{i}", policy=policy, label=f"{policy}, compression_ratio={i / 40:g}",
                    kv_fraction=1 - i / 40, read_fraction=1 - i / 40, x_full=1 - i / 50)

    def size(n):
        return Image.open(io.BytesIO(figure_png([rec(i) for i in range(n)], "t"))).size

    assert size(3) == size(SCATTER_MOST)  # the scatter: one size whatever the runs
    many, more = size(SCATTER_MOST + 1), size(2 * SCATTER_MOST)
    assert many != size(SCATTER_MOST) and many[0] == more[0] and more[1] > many[1]  # then a row per run


@pytest.mark.skipif(not HAS_QUANTO, reason="needs optimum-quanto (the eval extra)")
def test_eval_needles_end_to_end(tiny_dir, tmp_path, capsys):
    from kvkit.cli import main

    out = tmp_path / "nd"
    rc = main(["eval", "needles", "--model", tiny_dir, "--run", "full=full", "--run", "q4=quantized:nbits=4",
               "--run", "snap=snapkv:budget=128", "--out-root", str(out), "--lengths", "512", "--samples", "3",
               "--depths", "3"])
    assert rc == 0
    md = (out / "needles.md").read_text()
    assert "| q4 | quantized |" in md and "| snap | snapkv | budget=128 |" in md
    assert (out / "needles.png").stat().st_size > 1000
    rows = [json.loads(x) for x in (out / "snap" / "samples.jsonl").read_text().splitlines()]
    assert len(rows) == 3 and {r["task"] for r in rows} == {"digits", "uuid", "words"}
    assert all(0 < r["kv_read"] <= r["kv_bytes"] for r in rows)  # the bytes its last step read
    cfg = json.loads((out / "q4" / "config.json").read_text())
    assert cfg["protocol"] == "agnostic" and cfg["seed"] == needles.DEFAULT_SEED
    root = json.loads((out / "summary.json").read_text())  # the runs for other tools (kvkit eval compare OUT)
    assert root["schema"] == 1 and [r["folder"] for r in root["runs"]] == ["full", "q4", "snap"]
    assert json.loads((out / "snap" / "summary.json").read_text())["mean_kv_read"] > 0
    capsys.readouterr()
    assert main(["eval", "compare", str(out)]) == 0
    assert "| snapkv | budget=128 |" in capsys.readouterr().out
    assert main(["eval", "needles", "--model", tiny_dir, "--run", "a=full", "--run", "a=streaming",
                 "--out-root", str(out)]) == 2
    assert "run folder names must be unique" in capsys.readouterr().err


def test_a_setting_the_model_cannot_run_is_refused_before_any_run_folder_is_written(tiny_dir, tmp_path, capsys):
    """A ratio out of a policy's reach on this model is refused as ``kvkit.patch`` refuses it, naming the run,
    before a folder of any run (the runs that could run included) is created; the root stays empty."""
    from kvkit.cli import main

    out = tmp_path / "nd"
    rc = main(["eval", "needles", "--model", tiny_dir, "--policy", "full", "--policy",
               "shadowkv:compression_ratio=0.9,chunk_size=4", "--out", str(out), "--lengths", "512", "--samples", "2"])
    assert rc == 2
    err = capsys.readouterr().err
    assert "run 'shadowkv-compression_ratio0.9-chunk_size4'" in err and "reaches compression ratios in [0.000, 0.875]" in err
    assert not out.exists() or not any(out.iterdir())


def _script(name, monkeypatch):
    """A script of benchmarks/needles as a module, its folder on sys.path as when it runs (it imports siblings)."""
    from pathlib import Path

    folder = Path(__file__).resolve().parents[2] / "benchmarks" / "needles"
    monkeypatch.syspath_prepend(str(folder))
    spec = importlib.util.spec_from_file_location(name, folder / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_pooled_ratio_counts_only_the_needles_every_run_scored(tmp_path, capsys, monkeypatch):
    """benchmarks/needles/pooled_ratio.py: pooled over two roots, a needle one run lacks is dropped for every run,
    a needle full misses counts when the run answers it, and the interval holds the ratio."""
    pr = _script("pooled_ratio", monkeypatch)

    def write(root, run, scores):
        (root / run).mkdir(parents=True)
        (root / run / "samples.jsonl").write_text(
            "".join(json.dumps({"id": f"needle/{i}", "score": s}) + "\n" for i, s in enumerate(scores)))

    a, b = tmp_path / "a", tmp_path / "b"
    write(a, "full", [1, 1, 1, 0, 1])
    write(a, "x", [1, 0, 1, 1, 1])
    write(a, "y", [1, 1, 0, 0])  # lacks needle/4: dropped for x too
    write(b, "full", [1, 1])
    write(b, "x", [1, 0])
    write(b, "y", [1, 1])
    pairs = pr.pooled_pairs([a, b], ["x", "y"])
    assert pairs["x"] == [(1, 1), (1, 0), (1, 1), (0, 1), (1, 1), (1, 0)]
    ratio, lo, hi = pr.ratio_interval(pairs["x"], 500)
    assert ratio == 4 / 5 and lo <= ratio <= hi
    pr.main(["--roots", str(a), str(b), "--runs", "x", "y", "--resamples", "200"])
    out = capsys.readouterr().out
    assert "| x | 6 | 5 | 4 | 0.800 |" in out and "| y | 6 | 5 | 4 | 0.800 |" in out


def test_needle_runs_sharing_one_prefill_write_the_rows_each_writes_alone(tiny_dir, tmp_path):
    """Question-agnostic runs whose prefill replays share one prefill per sample, and their rows (answer, score,
    bytes held and read) are those of each run prefilled on its own; kvzip, whose prefill does not replay, runs
    alone beside them."""
    from kvkit.cli import main

    def rows(root):
        out = {}
        for name in ("full", "snap", "stream", "zip"):
            lines = (root / name / "samples.jsonl").read_text().splitlines()
            out[name] = [{k: r[k] for k in ("id", "prediction", "score", "kv_bytes", "kv_read") if k in r}
                         for r in map(json.loads, lines)]
        return out

    args = ["eval", "needles", "--model", tiny_dir, "--run", "full=full", "--run", "snap=snapkv:budget=128",
            "--run", "stream=streaming:budget=96", "--run", "zip=kvzip:budget=128", "--lengths", "512",
            "--samples", "3", "--depths", "3"]
    assert main(args + ["--out", str(tmp_path / "shared")]) == 0
    assert main(args + ["--out", str(tmp_path / "alone"), "--no-shared-prefill"]) == 0
    shared, alone = rows(tmp_path / "shared"), rows(tmp_path / "alone")
    assert shared == alone and all(len(v) == 3 for v in shared.values())
    first = json.loads((tmp_path / "shared" / "snap" / "samples.jsonl").read_text().splitlines()[0])
    assert "shared_prefill_seconds" in first  # it did share
    assert "shared_prefill_seconds" not in json.loads(
        (tmp_path / "shared" / "zip" / "samples.jsonl").read_text().splitlines()[0])
    assert "shared_prefill_seconds" not in json.loads(
        (tmp_path / "alone" / "snap" / "samples.jsonl").read_text().splitlines()[0])
