"""The command line of ``kvkit eval ruler|sweep|niah|needles|longbench|compare`` and ``kvkit bench`` (added to the
``kvkit`` console script): every subcommand's arguments, and which command runs it.

A subcommand's parser is built by its ``_add_<name>`` function (:data:`EVAL_COMMANDS` in ``kvkit eval --help``
order, then ``kvkit bench``); the command itself lives in :mod:`kvkit.evals.commands` (one module per command
family) and is imported only when it runs (:func:`_command`), so building the ``kvkit`` parser loads no eval code.
"""

from __future__ import annotations

from kvkit.cli_grammar import (
    add_alias,
    add_max_new_tokens,
    add_model,
    add_out,
    add_policy_options,
    check_device,
    choice_list,
    int_list,
    integer,
    lazy_command,
    nonnegative_float,
    nonnegative_int,
    policy_list,
    policy_spec,
    positive_float,
    positive_int,
)


def _check_device(args) -> None:
    """Refuse a CUDA ``--device`` torch has none of before the command's code (and any model) loads (``--shape``
    runs check their own device)."""
    if getattr(args, "device", None) is not None and not getattr(args, "shape", None):
        check_device(args.device)


def _command(module: str, name: str):
    """The command ``kvkit.evals.commands.<module>.<name>``, imported when it is called (after
    :func:`_check_device`)."""
    return lazy_command(f"kvkit.evals.commands.{module}", name, before=_check_device)


#: the dtypes a run may load the model in
DTYPES = ("float32", "bfloat16", "float16")


def _dtype(p, dtype="float32") -> None:
    p.add_argument("--dtype", default=dtype, choices=DTYPES, help="the model's dtype")


def _common(p, with_out=True):
    """The options of a single-policy run: model, ``--policy NAME[:KEY=VALUE,...]``, ``--budget``,
    ``--compression-ratio``, seed, device, dtype (and output, resume, chat, prefill protocol, generation cap)."""
    add_model(p)
    add_policy_options(p, several=False)
    p.add_argument("--seed", type=integer, default=None,
                   help="seed of the generated samples (default RULER's 42; with --prompts: the file's)")
    _dtype(p)
    if with_out:
        add_out(p, "output folder (default results/<bench>/<model>-<policy>-<len>)")
        p.add_argument("--resume", action="store_true", help="continue an interrupted run in --out")
        p.add_argument("--no-chat", action="store_true", help="do not apply the model's chat template")
        p.add_argument("--full-prompt-prefill", action="store_true",
                       help="prefill context and question together (default: the context is prefilled and "
                            "compressed first, then the question is fed, as kvpress does)")
        add_max_new_tokens(p, None, "cap the generation length of every sample (quick checks only)")


def _several(p, what: str) -> None:
    """``--policy`` repeated (one run folder each under ``--out``), ``--budget``, ``--compression-ratio``, and the
    hidden ``--run NAME=POLICY[:KEY=VALUE,...]`` of earlier releases (its NAME names the folder)."""
    add_policy_options(p, several=True, what=what)
    add_alias(p, "--run", "run", "--policy NAME[:KEY=VALUE,...]", append=True, metavar="NAME=POLICY[:KEY=VALUE,...]")


def _prompts_options(p) -> None:
    """``--dump-prompts`` / ``--prompts``: a run's samples written to a file, or read from one."""
    p.add_argument("--dump-prompts", default=None, metavar="FILE", help="write the prompts as jsonl and stop")
    p.add_argument("--prompts", default=None, metavar="FILE", help="run the prompts of a --dump-prompts file")


def _add_ruler(esub) -> None:
    """``kvkit eval ruler``: RULER's 13 tasks at one length, one policy."""
    r = esub.add_parser("ruler", help="RULER's 13 synthetic tasks at one context length")
    _common(r)
    r.add_argument("--length", type=positive_int, default=4096, help="prompt + generation tokens (model tokenizer)")
    r.add_argument("--tasks", default="all", help="all | comma-separated task names")
    r.add_argument("--samples", type=positive_int, default=None, help="samples per task (default 10)")
    _prompts_options(r)
    r.set_defaults(func=_command("ruler", "cmd_ruler"))


def _add_sweep(esub) -> None:
    """``kvkit eval sweep``: the prompts of a ``--dump-prompts`` file through several policies."""
    sw = esub.add_parser("sweep", help="RULER prompts through several policies sharing one exact prefill per sample")
    add_model(sw)
    _several(sw, "policy, written to OUT/<its label> like `kvkit eval ruler --out`")
    sw.add_argument("--prompts", required=True, metavar="FILE", help="a `kvkit eval ruler --dump-prompts` file")
    add_out(sw, "folder holding one run folder per --policy", required=True, old=("--out-root",))
    sw.add_argument("--resume", action="store_true", help="continue interrupted runs (each run folder separately)")
    sw.add_argument("--tasks", default="all", help="all | comma-separated task names")
    sw.add_argument("--samples", type=positive_int, default=None, help="first N samples per task")
    add_max_new_tokens(sw, None, "cap the generation length (quick checks only)")
    sw.add_argument("--seed", type=integer, default=None,
                    help="the seed the prompts were made with (default: the file's; another is refused)")
    _dtype(sw)
    sw.set_defaults(func=_command("ruler", "cmd_sweep"))


def _add_niah(esub) -> None:
    """``kvkit eval niah``: the depth x length grid of one needle task."""
    n = esub.add_parser("niah", help="needle in a haystack: depth x length grid and heatmap")
    _common(n)
    n.add_argument("--lengths", type=int_list("lengths"), default=[1024, 2048, 4096, 8192], metavar="N[,N...]",
                   help="context lengths")
    n.add_argument("--depths", type=positive_int, default=11, help="number of depths from 0%% to 100%%")
    n.add_argument("--samples", type=positive_int, default=1, help="samples per cell")
    n.add_argument("--task", default="niah_single_2", help="the RULER needle task used for each cell")
    _prompts_options(n)
    n.set_defaults(func=_command("niah", "cmd_niah"))


#: the needle values and haystacks of ``kvkit eval needles`` (kvkit.evals.needles.FORMATS / HAYSTACKS)
NEEDLE_FORMATS, NEEDLE_HAYSTACKS = ("digits", "uuid", "words"), ("essay", "squad")


def _add_needles(esub) -> None:
    """``kvkit eval needles``: fresh needles through policies and peers."""
    nd = esub.add_parser("needles", help="fresh needles no calibration saw: policies and peers, accuracy vs bytes")
    add_model(nd)
    _several(nd, "kvkit policy or a peer (quantized:nbits=4), written to OUT/<its label>; one must be full")
    add_out(nd, "folder holding one run folder per --policy, needles.md/png and summary.json", required=True,
            old=("--out-root",))
    nd.add_argument("--lengths", type=int_list("lengths"), default=[2048, 4096], metavar="N[,N...]",
                    help="prompt + generation lengths")
    nd.add_argument("--samples", type=positive_int, default=33, help="samples per length (formats and depths cycle)")
    nd.add_argument("--formats", type=choice_list(NEEDLE_FORMATS, "formats"), default=list(NEEDLE_FORMATS),
                    metavar="NAME[,NAME...]", help="needle values: digits, uuid, words")
    nd.add_argument("--no-shared-prefill", action="store_true",
                    help="prefill every run on its own (by default, question-agnostic runs whose prefill replays "
                         "share one exact prefill per sample: the same rows, fewer prefills)")
    nd.add_argument("--haystack", default="essay", choices=NEEDLE_HAYSTACKS,
                    help="essay (first 66%% of the essays) | squad (paragraphs)")
    nd.add_argument("--depths", type=positive_int, default=11, help="number of depths from 0%% to 100%%")
    nd.add_argument("--protocol", choices=["agnostic", "aware"], default="agnostic",
                    help="agnostic: context prefilled and compressed before the question; aware: together")
    nd.add_argument("--seed", type=integer, default=None,
                    help="sample seed (default kvkit.evals.needles.DEFAULT_SEED)")
    nd.add_argument("--resume", action="store_true", help="continue interrupted runs (each run folder separately)")
    _dtype(nd)
    nd.set_defaults(func=_command("needles", "cmd_needles"))


def _add_longbench(esub) -> None:
    """``kvkit eval longbench``: LongBench's tasks from the official files."""
    lb = esub.add_parser("longbench", help="LongBench's 21 tasks from the official jsonl files")
    _common(lb)
    lb.add_argument("--data-dir", default=None, help="folder with the official <task>.jsonl files")
    lb.add_argument("--tasks", default="all", help="all | comma-separated task names")
    lb.add_argument("--samples", type=positive_int, default=None, help="first N samples per task (default all)")
    lb.add_argument("--length", type=positive_int, default=None,
                    help="prompt + generation budget (default: model context)")
    lb.set_defaults(func=_command("longbench", "cmd_longbench"))


def _add_compare(esub) -> None:
    """``kvkit eval compare``: eval summaries joined into one table."""
    c = esub.add_parser("compare", help="join eval summaries into one policy x budget table with retention and bytes")
    c.add_argument("dirs", nargs="+", help="eval output folders (or summary.json files); a needles --out folder "
                                           "stands for its run folders")
    add_out(c, "also write compare.md / compare.csv in this folder")
    c.add_argument("--matched", action="store_true",
                   help="score every run only on the samples it shares with its baseline (from samples.jsonl: same "
                        "id and same prompt; runs of another seed, dtype, length or generation length are refused)")
    c.add_argument("--baseline", action="append", metavar="DIR",
                   help="the run retention is relative to (repeatable: one per benchmark/model/length/seed/dtype "
                        "setting). Default: the one `full` run of each setting; several full runs of one setting "
                        "need --baseline")
    c.set_defaults(func=_command("compare", "cmd_compare"))


def _add_bench(sub) -> None:
    """``kvkit bench``: the bundled-model bench (one-shot / chunked prefill, ``--batch``) and ``--shape``."""
    b = sub.add_parser("bench", help="prefill time, decode tok/s, peak memory, KV bytes: policy vs full")
    add_model(b)
    add_policy_options(b, several=True, what="policy measured against the full cache (the first is the main "
                                              "setting; --shape: the rows, hf-dynamic | hf-static | full | policy)")
    add_alias(b, "--add", "policy", "--policy NAME[:KEY=VALUE,...]", append=True, type=policy_spec,
              metavar="POLICY[:KEY=VALUE,...]")
    add_alias(b, "--policies", "shape_rows", "--policy ROW[:KEY=VALUE,...]", append=True, nargs="+", type=policy_list,
              metavar="ROW[:KEY=VALUE,...]")
    b.add_argument("--seed", type=integer, default=None, help="seed of the prompts (default 42)")
    _dtype(b, None)  # float32; --shape: bfloat16 on CUDA
    b.add_argument("--lengths", type=int_list("lengths"), default=None, metavar="N[,N...]",
                   help="prompt lengths (default 2048,4096,8192, each cut to leave room for the decoded tokens in "
                        "the model's context: 8160 for the bundled model; --shape: 16384)")
    b.add_argument("--decode-tokens", type=positive_int, default=32, help="tokens decoded after the prefill")
    b.add_argument("--prefill-chunk", type=positive_int, default=None, metavar="N",
                   help="also run chunked prefill (kvkit.prefill, N tokens per forward) for the policy and the "
                        "full cache, next to the one-shot prefill: peak prefill memory of both modes")
    b.add_argument("--batch", type=positive_int, default=None, metavar="B",
                   help="batched decode: B left-padded essay passages per length; every policy prefilled once, then "
                        "interleaved rounds of decode steps: step time, tok/s, KV held/read, byte bound, fraction of "
                        "it (with --prefill-chunk: the prefill-memory rows at batch B instead)")
    b.add_argument("--threads", type=int_list("threads"), default=None, metavar="N[,N...]",
                   help="torch CPU threads of the decode steps (each measured; default: torch's current count)")
    b.add_argument("--rounds", type=positive_int, default=3, help="--batch: interleaved rounds per thread count")
    b.add_argument("--steps", type=positive_int, default=None, help="--batch: timed decode steps per policy per "
                   "round (default 4); --shape: timed decode steps per row over all rounds (default 20)")
    b.add_argument("--memory", type=positive_float, default=None, metavar="GIB",
                   help="--batch: the largest batch whose KV fits in GIB GiB for each policy, and the decode "
                        "throughput measured there (capped at --max-batch)")
    b.add_argument("--max-batch", type=positive_int, default=32, help="--memory: largest batch actually decoded")
    b.add_argument("--profile", action="store_true",
                   help="--batch: torch.profiler over a few decode steps per policy, top ops by self CPU time")
    b.add_argument("--prefill-cache", default=None, metavar="DIR",
                   help="--batch: keep the recorded exact prefill in DIR and reuse it in later runs with the same "
                        "model and prompts (it does not depend on the policies)")
    b.add_argument("--oneshot", default="all", choices=("all", "full"),
                   help="--prefill-chunk: which settings also run the one-shot prefill")
    b.add_argument("--shape", default=None, metavar="NAME",
                   help="decode benchmark on random weights of a model shape (tiny | llama-3.2-1b | llama-3.1-8b; "
                        "nothing downloaded) instead of the bundled model: transformers' DynamicCache and compiled "
                        "StaticCache, kvkit full and every policy in one run (kvkit/evals/gpu/); default "
                        "--batch 16 --lengths 16384")
    b.add_argument("--warmup", type=nonnegative_int, default=3, help="--shape: untimed decode steps per row")
    b.add_argument("--time-limit", type=nonnegative_float, default=420.0, metavar="S",
                   help="--shape: seconds from the start after which the remaining rows are skipped")
    b.add_argument("--no-compile", action="store_true", help="--shape: run hf-static eager (no torch.compile)")
    b.add_argument("--compiled", dest="compiled", action="store_true", default=True,
                   help="--shape (default): after each kvkit policy with a static store (full, streaming, snapkv, "
                        "duo, cake, tidal) a '<policy> static+compile' row: kvkit.patch(..., static=True), eager "
                        "prefill, decode steps through model.get_compiled_call (CUDA graphs on CUDA); its compile "
                        "time is reported apart and counts against --time-limit")
    b.add_argument("--no-compiled", dest="compiled", action="store_false",
                   help="--shape: no kvkit static+compile rows")
    b.add_argument("--compile-backend", default="inductor", metavar="NAME",
                   help="--shape: torch.compile backend of hf-static and the static+compile rows (aot_eager: a "
                        "short compile for CPU tests, no speed-up to measure)")
    b.add_argument("--no-interleave", action="store_true",
                   help="--shape: do not keep kvkit full alive to interleave its steps with every row's")
    b.add_argument("--no-cudnn-sdpa", action="store_true",
                   help="--shape: torch.backends.cuda.enable_cudnn_sdp(False) for the whole run")
    b.add_argument("--grid", action="store_true",
                   help="with --shape: the production grid (batch x length cells that fit the card, transformers' "
                        "StaticCache + compile beside kvkit's compiled rows, prefill, peak memory, largest batch)")
    add_out(b, "output folder (default results/speed-cpu/<model>-<policy>-<len>; --shape: "
               "results/speed-gpu/<shape>-b<B>-<L>)")
    b.set_defaults(func=_command("bench", "cmd_bench"))


#: the ``kvkit eval`` subcommands, in ``--help`` order
EVAL_COMMANDS = (_add_ruler, _add_sweep, _add_niah, _add_needles, _add_longbench, _add_compare)


def add_eval(sub) -> None:
    """``kvkit eval``'s parser and its subcommands' (:data:`EVAL_COMMANDS`)."""
    ev = sub.add_parser("eval", help="long-context evaluations: ruler, sweep, niah, needles, longbench, compare")
    esub = ev.add_subparsers(dest="eval_command", required=True, metavar="EVAL")
    for add in EVAL_COMMANDS:
        add(esub)


def add_bench(sub) -> None:
    """``kvkit bench``'s parser."""
    _add_bench(sub)


def add_commands(sub) -> None:
    """``kvkit eval`` and ``kvkit bench`` (both parsers)."""
    add_eval(sub)
    add_bench(sub)
