"""The producer's regeneration of chat records says how far it is (``hf._prepare_records``): a line when it
starts, at most one per interval while it runs, and one when it is done; records without ``messages`` are not
regenerated and print nothing."""

from draftpipe_client import chat, hf


class Clock:
    """A clock that advances by ``step`` seconds at each reading."""

    def __init__(self, step):
        self.now, self.step = 0.0, step

    def __call__(self):
        self.now += self.step
        return self.now


def test_regeneration_prints_a_throttled_progress_line(monkeypatch, capsys):
    monkeypatch.setattr(chat, "prepare", lambda record, *args: {"input_ids": [1, 2], "seen": record})
    records = [(f"data.jsonl:{i}", {"messages": []}) for i in range(1, 21)]
    # Each record takes 1 s; a line every 5 s at most.
    prepared = hf._prepare_records(records, None, None, 16, 64, every=5.0, clock=Clock(1.0))
    assert len(prepared) == 20
    lines = capsys.readouterr().err.splitlines()
    assert lines[0] == "regenerating the assistant turns of 20 chat records with the target (up to 16 new tokens a turn)"
    progress = lines[1:]
    assert progress[-1].startswith("regenerated 20/20 records in 20 s")
    assert 3 <= len(progress) <= 5, progress


def test_nothing_to_regenerate_prints_nothing(monkeypatch, capsys):
    monkeypatch.setattr(chat, "prepare", lambda record, *args: record)
    records = [("data.jsonl:1", {"text": "hello"})]
    assert hf._prepare_records(records, None, None, 16, 64) == [{"text": "hello"}]
    assert hf._prepare_records([("data.jsonl:1", {"messages": []})], None, None, 0, 64) == [{"messages": []}]
    assert capsys.readouterr().err == ""
