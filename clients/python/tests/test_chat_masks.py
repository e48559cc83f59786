"""The chat encoder's mask checks (``draftpipe_client.chat.MaskReport``) on hand-made bad conversations, each kind
caught and named, and the producer's refusal before anything is sent (``hf._tokenize_checked``). No torch or
transformers: a character-level tokenizer renders ChatML (or a Qwen3-style template) and gives offsets."""

import re

import pytest

from draftpipe_client import DraftpipeError, chat, hf

SPECIAL = ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "<think>", "</think>"]


class CharTokenizer:
    """One token per character, special tokens whole; ``qwen3`` inserts an empty thinking block before each
    assistant reply, as Qwen3's template does for a reply without one; ``drop_end`` leaves ``<|im_end|>`` out of
    assistant turns (a template that loses it)."""

    eos_token_id = SPECIAL.index("<|im_end|>")

    def __init__(self, qwen3=False, drop_end=False):
        self.qwen3, self.drop_end = qwen3, drop_end
        self._split = re.compile("(" + "|".join(re.escape(t) for t in SPECIAL) + ")")

    def get_vocab(self):
        return {token: i for i, token in enumerate(SPECIAL)}

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=False):
        assert not tokenize
        text = ""
        for message in messages:
            content = message["content"]
            end = "<|im_end|>"
            if message["role"] == "assistant":
                content = ("<think>\n\n</think>\n\n" if self.qwen3 else "") + content
                end = "" if self.drop_end else end
            text += f"<|im_start|>{message['role']}\n{content}{end}\n"
        return text + ("<|im_start|>assistant\n" if add_generation_prompt else "")

    def __call__(self, text, add_special_tokens=False, return_offsets_mapping=False):
        ids, offsets, at = [], [], 0
        for piece in self._split.split(text):
            if piece in SPECIAL:
                ids.append(SPECIAL.index(piece))
                offsets.append((at, at + len(piece)))
            else:
                for i, char in enumerate(piece):
                    ids.append(100 + ord(char))
                    offsets.append((at + i, at + i + 1))
            at += len(piece)
        return {"input_ids": ids, "offset_mapping": offsets}

    def decode(self, ids, skip_special_tokens=False):
        return "".join(SPECIAL[i] if i < 100 else chr(i - 100) for i in ids)


GOOD = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
        {"role": "user", "content": "more"}, {"role": "assistant", "content": "sure"}]


def judge(tokenizer, conversations, max_length=None):
    report = chat.MaskReport.for_tokenizer(tokenizer)
    kinds = [report.add(*(lambda e: (e.input_ids, e.loss_mask))(chat.encode(tokenizer, messages, max_length)),
                        f"data.jsonl:{line}")
             for line, messages in enumerate(conversations, 1)]
    return report, kinds


def test_a_good_conversation_has_no_bad_kind_and_its_loss_share_is_counted():
    tokenizer = CharTokenizer()
    report, kinds = judge(tokenizer, [GOOD])
    assert kinds == [[]]
    encoded = chat.encode(tokenizer, GOOD)
    assert report.tokens == len(encoded.input_ids) and report.loss_tokens == sum(encoded.loss_mask)
    # "hello" and "sure", each with its end token (one token per character: no header newline merges in).
    assert report.loss_tokens == 5 + 1 + 4 + 1
    assert report.loss_token_share == pytest.approx(11 / report.tokens)
    report.check()  # nothing bad: no error


def test_a_conversation_with_no_user_turn_trains_its_header_too_all_ones():
    report, kinds = judge(CharTokenizer(), [[{"role": "assistant", "content": "hello"}]])
    assert kinds == [["all_ones"]]
    assert report.kinds["all_ones"].first_ids == ["data.jsonl:1"]


def test_a_conversation_without_an_assistant_turn_has_no_loss_all_zeros():
    report, kinds = judge(CharTokenizer(), [GOOD, [{"role": "user", "content": "hi"}]])
    assert kinds == [[], ["all_zeros"]]
    assert report.kinds["all_zeros"].first_ids == ["data.jsonl:2"]


def test_a_reply_cut_by_max_length_misses_its_end_of_turn():
    tokenizer = CharTokenizer()
    full = len(chat.encode(tokenizer, GOOD).input_ids)
    report, kinds = judge(tokenizer, [GOOD], max_length=full - 3)  # the last reply's end token is cut off
    assert kinds == [["missing_end_of_turn"]]


def test_a_template_that_drops_the_end_of_turn_token_is_caught():
    report, kinds = judge(CharTokenizer(drop_end=True), [GOOD])
    assert kinds == [["missing_end_of_turn"]]
    assert report.kinds["missing_end_of_turn"].count == 1


def test_an_empty_thinking_block_in_the_mask_is_caught():
    report, kinds = judge(CharTokenizer(qwen3=True), [GOOD])
    assert kinds == [["empty_thinking"]]
    assert report.kinds["empty_thinking"].first_ids == ["data.jsonl:1"]
    # A thinking block with content is what the model wrote: not flagged.
    thought = [GOOD[0], {"role": "assistant", "content": "<think>\nplan\n</think>\n\nhello"}]
    _, kinds = judge(CharTokenizer(), [thought])
    assert kinds == [[]]


def test_over_the_bound_the_error_names_each_kind_its_count_and_first_ids():
    tokenizer = CharTokenizer()
    conversations = [GOOD] * 96 + [[{"role": "assistant", "content": "x"}],
                                   [{"role": "user", "content": "x"}],
                                   [{"role": "user", "content": "x"}]]
    report, _ = judge(tokenizer, conversations)
    qwen3, _ = judge(CharTokenizer(qwen3=True), [GOOD])
    with pytest.raises(chat.MaskError) as caught:
        report.check(0.01)
    message = str(caught.value)
    for needle in ["99 conversations", "bad masks 3 (3.0%)", "all_ones 1 (data.jsonl:97)",
                   "all_zeros 2 (data.jsonl:98, data.jsonl:99)", "missing_end_of_turn 0", "empty_thinking 0",
                   "over the bound of 1% bad"]:
        assert needle in message, (needle, message)
    assert isinstance(caught.value, chat.ChatError) and isinstance(caught.value, DraftpipeError)
    report.check(0.05)  # 3% is within 5%
    with pytest.raises(chat.MaskError, match="empty_thinking 1"):
        qwen3.check()
    with pytest.raises(chat.ChatError, match="0..1"):
        report.check(2.0)


def test_first_ids_stop_at_the_limit():
    report, _ = judge(CharTokenizer(), [[{"role": "user", "content": "x"}]] * (chat.FIRST_IDS + 2))
    assert report.kinds["all_zeros"].count == chat.FIRST_IDS + 2
    assert len(report.kinds["all_zeros"].first_ids) == chat.FIRST_IDS
    assert report.summary().count("data.jsonl:") == chat.FIRST_IDS and ", …)" in report.summary()


def test_check_masks_judges_encoded_pairs():
    tokenizer = CharTokenizer()
    report = chat.check_masks(tokenizer, [("a:1", chat.encode(tokenizer, GOOD))])
    assert report.sequences == 1 and report.bad_sequences == 0
    with pytest.raises(chat.MaskError, match=r"all_zeros 1 \(a:1\)"):
        chat.check_masks(tokenizer, [("a:1", chat.Encoded([5, 6], [0, 0]))])


def test_the_producer_refuses_bad_chat_data_before_anything_is_sent(capsys):
    tokenizer = CharTokenizer()
    records = [chat.prepare({"messages": GOOD}, tokenizer, None, 0, None, f"chat.jsonl:{i}") for i in range(1, 4)]
    records.append({"text": "plain text is not judged"})
    full = len(records[0]["input_ids"])
    sequences, masks = hf._tokenize_checked(tokenizer, records[:3], full, 2, 0.01)
    assert len(sequences) == 6 and masks[0] == records[0]["loss_mask"]
    assert "chat masks: 3 conversations" in capsys.readouterr().err
    # The run's largest bucket cuts every reply's end token: refused, naming the records.
    with pytest.raises(chat.MaskError, match=r"missing_end_of_turn 3 \(chat.jsonl:1, chat.jsonl:2, chat.jsonl:3\)"):
        hf._tokenize_checked(tokenizer, records[:3], full - 3, 1, 0.01)
    # Only chat records are judged: a text record needs no assistant mask.
    report = chat.MaskReport.for_tokenizer(tokenizer)
    hf._tokenize(_TextTokenizer(), records[3:], 16, report)
    assert report.sequences == 0


class _TextTokenizer:
    def __call__(self, text, truncation=True, max_length=None):
        return {"input_ids": list(range(len(text)))[:max_length]}
