"""Every eval metric on hand-made cases (RULER string match, LongBench en/zh metrics)."""

import pytest

from kvkit.evals import metrics as m


def test_string_match_all():
    assert m.string_match_all("The numbers are 123 and 456.", ["123", "456"]) == 1.0
    assert m.string_match_all("only 123 here", ["123", "456"]) == 0.5
    assert m.string_match_all("ABC-Def", ["abc-def"]) == 1.0  # case-insensitive
    assert m.string_match_all("nothing", ["x1", "x2", "x3", "x4"]) == 0.0
    with pytest.raises(ValueError):
        m.string_match_all("x", [])


def test_string_match_part():
    assert m.string_match_part("It was in France.", ["france", "Paris"]) == 1.0
    assert m.string_match_part("It was in Spain.", ["france", "Paris"]) == 0.0


def test_normalize_and_qa_f1():
    assert m.normalize_answer("The  Eiffel, Tower!") == "eiffel tower"
    assert m.qa_f1("the Eiffel Tower", "Eiffel Tower") == 1.0
    # pred tokens {eiffel, tower, paris}, ref {eiffel, tower}: P=2/3, R=1 -> F1=0.8
    assert m.qa_f1("Eiffel Tower, Paris", "Eiffel Tower") == pytest.approx(0.8)
    assert m.qa_f1("London", "Eiffel Tower") == 0.0
    assert m.qa_f1("", "x") == 0.0


def test_qa_f1_zh():
    assert m.qa_f1_zh("北京。", "北京") == 1.0
    assert m.qa_f1_zh("上海", "北京") == 0.0
    s = m.qa_f1_zh("中国的首都是北京", "北京")
    assert 0.0 < s < 1.0


def test_rouge_l_en():
    assert m.rouge_l("the cat sat on the mat", "the cat sat on the mat") == pytest.approx(1.0)
    # LCS("the cat sat", "the cat ate") = 2 -> P=R=2/3
    assert m.rouge_l("the cat sat", "the cat ate") == pytest.approx(2 / 3)
    assert m.rouge_l("", "the cat") == 0.0


def test_rouge_l_zh():
    assert m.rouge_l_zh("今天天气很好", "今天天气很好") == pytest.approx(1.0)
    assert m.rouge_l_zh("我喜欢苹果", "他讨厌香蕉") < 0.5
    assert 0.0 < m.rouge_l_zh("会议讨论了预算问题", "会议讨论了人员问题") < 1.0
    assert m.rouge_l_zh("", "北京") == 0.0


def test_classification():
    classes = ["Location", "Person", "Entity", "Number"]
    assert m.classification("Location", "Location", all_classes=classes) == 1.0
    assert m.classification("Location or Person", "Location", all_classes=classes) == 0.5
    assert m.classification("Number", "Location", all_classes=classes) == 0.0
    # a shorter class contained in the reference is not counted against it
    assert m.classification("Abbreviation", "Abbreviation", all_classes=["Abbreviation", "Abbrev"]) == 1.0
    with pytest.raises(ValueError):
        m.classification("x", "y", all_classes=None)


def test_retrieval_en_zh():
    assert m.retrieval("Paragraph 12", "Paragraph 12") == 1.0
    assert m.retrieval("Paragraph 3 or Paragraph 12", "Paragraph 12") == 0.5
    assert m.retrieval("no idea", "Paragraph 12") == 0.0
    assert m.retrieval_zh("段落5", "段落5") == 1.0
    assert m.retrieval_zh("段落4", "段落5") == 0.0


def test_count():
    assert m.count("There are 7 unique paragraphs.", 7) == 1.0
    assert m.count("7 or 8", "7") == 0.5
    assert m.count("many", 7) == 0.0


def test_code_sim():
    assert m.code_sim("return x + 1\nfoo()", "return x + 1") == 1.0
    # comment and fence lines are skipped: the first code line is scored
    assert m.code_sim("```python\n# next\nreturn x + 1", "return x + 1") == 1.0
    assert m.code_sim("zzz", "return x + 1") < 0.3


def test_best_of_takes_max_over_references():
    assert m.best_of(m.qa_f1, "Paris", ["London", "paris"]) == 1.0
    assert set(m.METRICS) >= {"qa_f1", "qa_f1_zh", "rouge_l", "rouge_l_zh", "classification", "retrieval",
                              "retrieval_zh", "count", "code_sim", "string_match_all", "string_match_part"}
