"""RULER's 13 synthetic tasks (Hsieh et al., arXiv:2404.06654): their templates, the task table, and how one
sample's text is built at a given haystack size.

Templates, answer prefixes, generation lengths and metrics follow RULER's official ``synthetic.yaml`` and
``data/synthetic/constants.py``. A builder (:func:`build`) turns ``(task, seed, size)`` into a :class:`Built`: the
user message, the answer prefix, the reference outputs and the haystack (everything after it, question and answer
prefix, is fed after compression). ``size`` counts the task's unit: haystack words (niah, vt, qa), words in the list
(cwe), coded words (fwe); :func:`kvkit.evals.ruler.generate_sample` searches the size that fits a token length.

- niah (8 tasks): keys and values (words, numbers, uuids) as needles in an essay, a repeated noise text or other
  needles, at random RULER depths or one given depth; one or several keys, values and queries;
- vt: variable-assignment chains hidden in noise, with one solved in-context example;
- cwe: the 10 most common words of a numbered list (fewer repeats below 4K), with an example;
- fwe: the 3 most frequent words of a Zipf-distributed coded text (the top word is noise);
- qa_1 / qa_2: a SQuAD / HotpotQA question over its gold documents shuffled among distractors.
"""

from __future__ import annotations

import random
import string
import uuid
from dataclasses import dataclass, field

from kvkit.evals.haystack import (
    SENTENCE_END,
    essay_words,
    insert_at_depths,
    qa_data,
    units_of_words,
    word_lists,
)

NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
NEEDLE = "One of the special magic {type_needle_v} for {key} is: {value}."
DEPTHS = [round(100 * i / 39) for i in range(40)]  # RULER: np.linspace(0, 100, 40) rounded

TEMPLATES = {  # RULER data/synthetic/constants.py
    "niah": (
        "Some special magic {type_needle_v} are hidden within the following text. Make sure to memorize it. "
        "I will quiz you about the {type_needle_v} afterwards.\n{context}\nWhat are all the special magic "
        "{type_needle_v} for {query} mentioned in the provided text?",
        " The special magic {type_needle_v} for {query} mentioned in the provided text are",
        128,
    ),
    "variable_tracking": (
        "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n{context}\n"
        "Question: Find all variables that are assigned the value {query} in the text above.",
        " Answer: According to the chain(s) of variable assignment in the text above, {num_v} variables are "
        "assgined the value {query}, they are: ",
        30,
    ),
    "common_words_extraction": (
        "Below is a numbered list of words. In these words, some appear more often than others. Memorize the "
        "ones that appear most often.\n{context}\nQuestion: What are the 10 most common words in the above list?",
        " Answer: The top 10 words that appear most often in the list are:",
        120,
    ),
    "freq_words_extraction": (
        "Read the following coded text and track the frequency of each coded word. Find the three most "
        "frequently appeared coded words. {context}\nQuestion: Do not provide any explanation. Please ignore "
        "the dots '....'. What are the three most frequently appeared words in the above coded text?",
        " Answer: According to the coded text above, the three most frequently appeared words are:",
        50,
    ),
    "qa": (
        "Answer the question based on the given documents. Only give me the answer and do not output any "
        "other words.\n\nThe following are given documents.\n\n{context}\n\nAnswer the question based on the "
        "given documents. Only give me the answer and do not output any other words.\n\nQuestion: {query}",
        " Answer:",
        32,
    ),
}


@dataclass(frozen=True)
class Task:
    name: str
    kind: str  # a key of TEMPLATES
    metric: str  # string_match_all | string_match_part
    args: dict = field(default_factory=dict)

    @property
    def tokens_to_generate(self) -> int:
        return TEMPLATES[self.kind][2]


def _niah(name, haystack, k, v, nk=1, nv=1, nq=1):
    return Task(name, "niah", "string_match_all", dict(type_haystack=haystack, type_needle_k=k, type_needle_v=v,
                                                       num_needle_k=nk, num_needle_v=nv, num_needle_q=nq))


TASKS = {t.name: t for t in [  # RULER synthetic.yaml
    _niah("niah_single_1", "repeat", "words", "numbers"),
    _niah("niah_single_2", "essay", "words", "numbers"),
    _niah("niah_single_3", "essay", "words", "uuids"),
    _niah("niah_multikey_1", "essay", "words", "numbers", nk=4),
    _niah("niah_multikey_2", "needle", "words", "numbers"),
    _niah("niah_multikey_3", "needle", "uuids", "uuids"),
    _niah("niah_multivalue", "essay", "words", "numbers", nv=4),
    _niah("niah_multiquery", "essay", "words", "numbers", nq=4),
    Task("vt", "variable_tracking", "string_match_all", dict(num_chains=1, num_hops=4)),
    Task("cwe", "common_words_extraction", "string_match_all", dict(freq_cw=30, freq_ucw=3, num_cw=10)),
    Task("fwe", "freq_words_extraction", "string_match_all", dict(alpha=2.0)),
    Task("qa_1", "qa", "string_match_part", dict(dataset="squad")),
    Task("qa_2", "qa", "string_match_part", dict(dataset="hotpotqa")),
]}


@dataclass
class Built:
    user: str  # the user message (task template filled in)
    answer_prefix: str
    outputs: list[str]
    meta: dict
    context: str = ""  # the haystack; everything after it (question, answer prefix) is fed after compression


def _random_value(rng: random.Random, kind: str) -> str:
    if kind == "numbers":
        return str(rng.randint(10**6, 10**7 - 1))
    if kind == "words":
        w = word_lists()
        return f"{rng.choice(w['adjective'])}-{rng.choice(w['noun'])}"
    if kind == "uuids":
        return str(uuid.UUID(int=rng.getrandbits(128), version=4))
    raise ValueError(f"unknown needle type {kind!r}")


def build_niah(task: Task, seed: int, size: int, depth: float | None = None) -> Built:
    a = task.args
    rng = random.Random(seed)
    nk = max(a["num_needle_k"], a["num_needle_q"])
    tv = a["type_needle_v"]
    keys, values, needles = [], [], []
    for _ in range(nk):
        keys.append(_random_value(rng, a["type_needle_k"]))
        vals = [_random_value(rng, tv) for _ in range(a["num_needle_v"])]
        values.append(vals)
        needles += [NEEDLE.format(type_needle_v=tv, key=keys[-1], value=v) for v in vals]
    random.Random(seed).shuffle(needles)
    if depth is None:
        depths = sorted(rng.sample(DEPTHS, len(needles)))
    else:
        depths = [depth] * len(needles)
    queried = rng.sample(range(nk), a["num_needle_q"])
    dist_rng = random.Random(seed + 1)
    hay = a["type_haystack"]
    if hay == "essay":
        units = SENTENCE_END.split(" ".join(essay_words()[:size]).strip())
        sep = " "
    elif hay == "repeat":
        units = units_of_words(lambda i: NOISE, size)
        sep = "\n"
    elif hay == "needle":
        distractors = []

        def unit(i):
            while len(distractors) <= i:
                distractors.append(NEEDLE.format(type_needle_v=tv, key=_random_value(dist_rng, a["type_needle_k"]),
                                                 value=_random_value(dist_rng, tv)))
            return distractors[i]

        units = units_of_words(unit, size)
        sep = "\n"
    else:
        raise ValueError(f"unknown haystack {hay!r}")
    context = sep.join(insert_at_depths(units, needles, depths))
    queries = [keys[i] for i in queried]
    answers = [v for i in queried for v in values[i]]
    query = ", ".join(queries[:-1]) + ", and " + queries[-1] if len(queries) > 1 else queries[0]
    template, prefix, _ = TEMPLATES["niah"]
    if a["num_needle_q"] * a["num_needle_v"] == 1:  # RULER's singular wording
        for old, new in (("Some", "A"), ("are all", "is"), ("are", "is"), ("answers", "answer")):
            template, prefix = template.replace(old, new), prefix.replace(old, new)
        tv = tv[:-1]
    user = template.format(type_needle_v=tv, context=context, query=query)
    return Built(user, prefix.format(type_needle_v=tv, query=query), answers,
                 dict(needles=needles, depths=depths, haystack=hay), context)


def _vt_text(rng: random.Random, noises: int, num_chains: int, num_hops: int, icl: bool):
    k = 3 if icl else 5
    hops = min(10, num_hops) if icl else num_hops
    n = (hops + 1) * num_chains
    names: list[str] = []
    while len(set(names)) < n:
        names.append("".join(rng.choices(string.ascii_uppercase, k=k)))
    names = list(dict.fromkeys(names))[:n]
    chains, chain_vars = [], []
    for c in range(num_chains):
        vs = names[c * (hops + 1):(c + 1) * (hops + 1)]
        chain_vars.append(vs)
        chains.append([f"VAR {vs[0]} = {rng.randint(10000, 99999)}"] + [
            f"VAR {vs[j + 1]} = VAR {vs[j]} " for j in range(hops)])
    sents = SENTENCE_END.split(NOISE)
    units = units_of_words(lambda i: sents[i % len(sents)] + ("\n" if i % len(sents) == len(sents) - 1 else ""),
                           noises)
    positions = []
    for chain in chains:
        pos = sorted(rng.sample(range(len(units) + 1), len(chain))) if len(units) + 1 >= len(chain) else \
            list(range(len(chain)))
        positions.append(pos)
        for j, (p, stmt) in enumerate(zip(pos, chain)):
            units.insert(min(p + j, len(units)), stmt)
    context = " ".join(units).replace(". \n", ".\n")
    value = chains[0][0].split("=")[-1].strip()
    template, prefix, _ = TEMPLATES["variable_tracking"]
    return (template.format(context=context, query=value), prefix.format(num_v=hops + 1, query=value),
            chain_vars[0], chains[0], context)


def build_vt(task: Task, seed: int, size: int) -> Built:
    a = task.args
    # RULER prepends one solved in-context example (3-letter names, a small noise haystack)
    icl_user, icl_prefix, icl_ans, _, _ = _vt_text(random.Random(seed ^ 0x5EED), 40, a["num_chains"], a["num_hops"], True)
    user, prefix, answers, chain, context = _vt_text(random.Random(seed), size, a["num_chains"], a["num_hops"], False)
    example = icl_user + icl_prefix + " ".join(icl_ans)
    return Built(example + "\n\n" + user, prefix, answers, dict(chain=chain), context)


def build_cwe(task: Task, seed: int, size: int, target: int) -> Built:
    a = task.args
    w = word_lists()
    words = sorted(set(w["noun"] + w["adjective"] + w["verb"]))
    random.Random(seed).shuffle(words)
    rng = random.Random(seed)

    def example(num_words, common, uncommon, num_cw):
        full = rng.sample(words, num_words)
        cw, ucw = full[:num_cw], full[num_cw:]
        lst = cw * common + ucw * uncommon
        random.Random(seed).shuffle(lst)
        return " ".join(f"{i + 1}. {x}" for i, x in enumerate(lst)), cw

    size = min(size, len(words))
    if target < 4096:  # RULER: fewer repeats below 4K
        ex_ctx, ex_ans = example(20, 3, 1, a["num_cw"])
        ctx, ans = example(size, 6, 1, a["num_cw"])
    else:
        ex_ctx, ex_ans = example(40, 10, 3, a["num_cw"])
        ctx, ans = example(size, a["freq_cw"], a["freq_ucw"], a["num_cw"])
    template, prefix, _ = TEMPLATES["common_words_extraction"]
    ex = template.format(context=ex_ctx) + prefix + " " + " ".join(f"{i + 1}. {x}" for i, x in enumerate(ex_ans))
    return Built(ex + "\n" + template.format(context=ctx), prefix, ans, dict(num_words=size), ctx)


def _zeta(alpha: float, terms: int = 100_000) -> float:
    return sum(k ** -alpha for k in range(1, terms)) + terms ** (1 - alpha) / (alpha - 1)


def build_fwe(task: Task, seed: int, size: int, target: int) -> Built:
    alpha = task.args["alpha"]
    rng = random.Random(seed)
    vocab_size = max(target // 50, 10)
    vocab: list[str] = []
    while len(set(vocab)) < vocab_size:
        vocab.append("".join(rng.choices(string.ascii_lowercase, k=6)))
    vocab = sorted(set(vocab))
    random.Random(seed).shuffle(vocab)
    vocab[0] = "..."  # the top-ranked word is noise
    z = _zeta(alpha)
    counts = [int(size * (k ** -alpha) / z) for k in range(1, len(vocab) + 1)]
    text = [wd for wd, c in zip(vocab, counts) for _ in range(c)]
    random.Random(seed).shuffle(text)
    template, prefix, _ = TEMPLATES["freq_words_extraction"]
    return Built(template.format(context=" ".join(text)), prefix, vocab[1:4], dict(counts=counts[:4]), " ".join(text))


def build_qa(task: Task, seed: int, size: int, index: int) -> Built:
    qas, docs = qa_data(task.args["dataset"])
    q = qas[index % len(qas)]
    rng = random.Random(seed)
    gold = list(dict.fromkeys(q["context"]))
    excluded = set(gold) | set(q["more"])
    pool = [i for i in rng.sample(range(len(docs)), min(len(docs), 400)) if i not in excluded]
    extra = list(q["more"]) + pool
    gold_words = sum(len(docs[i].split(" ")) for i in gold)
    distract = units_of_words(lambda i: docs[extra[i]], max(0, size - gold_words)) if size > gold_words else []
    all_docs = [(True, docs[i]) for i in gold] + [(False, d) for d in distract]
    random.Random(seed).shuffle(all_docs)
    context = "\n\n".join(f"Document {i + 1}:\n{d}" for i, (_, d) in enumerate(all_docs))
    gold_pos = [i for i, (g, _) in enumerate(all_docs) if g]
    template, prefix, _ = TEMPLATES["qa"]
    return Built(template.format(context=context, query=q["query"]), prefix, list(q["outputs"]),
                 dict(gold_docs=[docs[i] for i in gold], gold_positions=gold_pos, num_docs=len(all_docs)), context)


def build(task: Task, seed: int, size: int, target: int, index: int, depth: float | None = None) -> Built:
    if task.kind == "niah":
        return build_niah(task, seed, size, depth)
    if task.kind == "variable_tracking":
        return build_vt(task, seed, size)
    if task.kind == "common_words_extraction":
        return build_cwe(task, seed, size, target)
    if task.kind == "freq_words_extraction":
        return build_fwe(task, seed, size, target)
    return build_qa(task, seed, size, index)
