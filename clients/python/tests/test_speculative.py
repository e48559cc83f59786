"""The draft-and-verify loop (``draftpipe_client.speculative``) on a random small Qwen3 target with a random
exported drafter: its output is the target's greedy decode, its bookkeeping counts what was accepted, and
deliberate mistakes in verification or in what the drafter is fed are caught."""

import json
import math

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from draftpipe_client import speculative  # noqa: E402
from draftpipe_client.drafter import Drafter, DrafterConfig, DrafterError, tensor_shapes  # noqa: E402
from draftpipe_client.speculative import Report, SpeculativeDecoder, SpeculativeError, evaluate  # noqa: E402

VOCAB, HIDDEN, BLOCK, MASK = 96, 32, 4, 95
LAYER_IDS = [0, 2]


def make_target(seed=0):
    torch.manual_seed(seed)
    config = transformers.Qwen3Config(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=3, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, max_position_embeddings=256, tie_word_embeddings=False,
    )
    model = transformers.Qwen3ForCausalLM(config).double().eval()
    # Sharper logits than the initialisation's, so greedy decoding is far from ties.
    with torch.no_grad():
        model.lm_head.weight.mul_(30.0)
    return model


def export_drafter(directory, seed=1, block=BLOCK):
    """A random drafter written as `draftpipe run --save` exports one: z-lab's config keys and tensor names."""
    from safetensors.torch import save_file

    config = {
        "architectures": ["DFlashDraftModel"], "model_type": "qwen3", "block_size": block,
        "dflash_config": {"mask_token_id": MASK, "target_layer_ids": LAYER_IDS}, "num_target_layers": 3,
        "hidden_size": HIDDEN, "intermediate_size": 48, "num_hidden_layers": 2, "num_attention_heads": 2,
        "num_key_value_heads": 1, "head_dim": 16, "rope_theta": 10000.0, "rms_norm_eps": 1e-6,
        "vocab_size": VOCAB,
    }
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config))
    generator = torch.Generator().manual_seed(seed)
    dims = DrafterConfig.from_json(config, "test")
    tensors = {}
    for name, shape in tensor_shapes(dims):
        if len(shape) == 1:
            tensors[name] = 1.0 + 0.1 * torch.randn(shape, generator=generator)
        else:
            tensors[name] = torch.randn(shape, generator=generator) / math.sqrt(shape[1])
    save_file(tensors, str(directory / "model.safetensors"))
    return directory


PROMPTS = [[5, 17, 33, 2, 60], [7, 7, 8], [90, 1, 44, 12, 13, 70, 21], [3]]


@pytest.fixture(scope="module")
def decoder(tmp_path_factory):
    drafter = Drafter.load(export_drafter(tmp_path_factory.mktemp("draft")), dtype=torch.float64)
    return SpeculativeDecoder(make_target(), drafter)


def test_output_equals_greedy_decoding_on_a_random_target(decoder):
    report = evaluate(decoder, PROMPTS, max_new_tokens=24, eos=None)
    assert report.prompts == len(PROMPTS) and report.generated == 24 * len(PROMPTS)
    assert 1.0 <= report.tau <= BLOCK
    # Every verify forward yields its accepted length; the prefill yields the first token.
    assert sum(report.accepted) >= report.generated - report.prompts
    assert report.blocks_compared > 0 and report.draft_mismatches == 0
    assert report.forwards_per_token == pytest.approx((report.prompts + report.verify_forwards) / report.generated)


def test_eos_stops_like_greedy_decoding(decoder):
    greedy = decoder.greedy(PROMPTS[0], 24, eos=None)
    eos = greedy[5]  # a token the target emits: both decodes must stop right after its first occurrence
    decoded = decoder.generate(PROMPTS[0], 24, eos)
    assert decoded.tokens == greedy[: greedy.index(eos) + 1] == decoder.greedy(PROMPTS[0], 24, eos)


class OracleDecoder(SpeculativeDecoder):
    """Drafts the target's greedy continuation in the first `right` slots and a wrong token after them."""

    right = 2
    greedy_tokens: list = []
    prompt_len = 0

    def _draft(self, features, start, bonus):
        block = super()._draft(features, start, bonus)
        offset = start - self.prompt_len
        for k in range(1, len(block)):
            truth = self.greedy_tokens[offset + k] if offset + k < len(self.greedy_tokens) else 0
            block[k] = truth if k <= self.right else (truth + 1) % VOCAB
        return block


def oracle(decoder, right, prompt, max_new):
    o = OracleDecoder(decoder.target, decoder.drafter)
    o.right, o.prompt_len = right, len(prompt)
    o.greedy_tokens = decoder.greedy(prompt, max_new + BLOCK + 1, eos=None)
    return o


@pytest.mark.parametrize("right", [0, 1, 2, 3])
def test_accepted_lengths_and_positions_count_what_the_target_accepts(decoder, right):
    prompt, max_new = PROMPTS[2], 25
    o = oracle(decoder, right, prompt, max_new)
    decoded = o.generate(prompt, max_new, eos=None)
    assert decoded.tokens == o.greedy_tokens[:max_new]
    # Each block accepts exactly `right` drafts plus the bonus token.
    assert decoded.accepted == [right + 1] * len(decoded.accepted)
    assert len(decoded.accepted) == math.ceil((max_new - 1) / (right + 1))
    report = Report(block=BLOCK, accepted=decoded.accepted)
    assert report.tau == right + 1
    assert report.acceptance_by_position() == [1.0] * right + [0.0] * (BLOCK - 1 - right)


def test_an_off_by_one_in_acceptance_is_caught(decoder, monkeypatch):
    original = speculative.accepted_drafts
    monkeypatch.setattr(speculative, "accepted_drafts", lambda d, p: min(original(d, p) + 1, BLOCK - 1))
    with pytest.raises(SpeculativeError, match="differs from the target's greedy decode"):
        evaluate(decoder, PROMPTS, max_new_tokens=16, eos=None)


def test_an_off_by_one_in_the_bonus_token_is_caught(decoder, monkeypatch):
    monkeypatch.setattr(speculative, "bonus_token", lambda posterior, accepted: int(
        posterior[min(accepted + 1, len(posterior) - 1)]))
    with pytest.raises(SpeculativeError, match="differs from the target's greedy decode"):
        evaluate(decoder, PROMPTS, max_new_tokens=16, eos=None)


def test_an_off_by_one_in_the_block_positions_is_caught(decoder, monkeypatch):
    monkeypatch.setattr(speculative, "block_positions", lambda start, block: speculative.torch.arange(
        start + 1, start + 1 + block)[None, :])
    with pytest.raises(SpeculativeError):
        evaluate(decoder, PROMPTS, max_new_tokens=16, eos=None)


class ShortContextDecoder(SpeculativeDecoder):
    """Drafts without the context feature of the last accepted position (an off-by-one in the context)."""

    def _draft(self, features, start, bonus):
        return super()._draft(features[:, : start - 1], start - 1, bonus)


def test_a_draft_fed_other_context_than_training_is_caught(decoder):
    wrong = ShortContextDecoder(decoder.target, decoder.drafter)
    with pytest.raises(SpeculativeError, match="differ from the teacher-forced drafter's block"):
        evaluate(wrong, PROMPTS[:3], max_new_tokens=16, eos=None)


def test_context_features_are_the_hidden_states_the_producer_taps():
    # The producer sends hidden_states[tap] for tap_layers; the export says target_layer_ids = tap_layers - 1.
    hidden_states = [torch.full((1, 2, 3), float(i)) for i in range(5)]
    features = speculative.context_features(hidden_states, [0, 3])
    assert features[0, 0].tolist() == [1.0] * 3 + [4.0] * 3


def test_teacher_forced_tau_is_the_training_formula():
    report = Report(block=4, tf_correct=torch.tensor([8, 4, 1]), tf_counted=torch.tensor([10, 10, 8]))
    assert report.slot_accuracy() == [0.8, 0.4, 0.125]
    assert report.teacher_forced_tau_simulated == pytest.approx(1 + 0.8 + 0.8 * 0.4 + 0.8 * 0.4 * 0.125)


def test_teacher_forced_exact_tau_is_the_brute_force_prefix_count():
    # Correlated misses: blocks right everywhere or wrong from slot 1, so the marginals multiply to less.
    correct = torch.tensor([[True, True, True], [False, True, True], [True, True, True], [False, False, True]])
    counted = torch.ones_like(correct)
    report = Report(block=4, tf_correct=torch.zeros(3, dtype=torch.long), tf_counted=torch.zeros(3, dtype=torch.long))
    report.add_teacher_forced(correct, counted)
    brute = 1 + sum(next((k for k, c in enumerate(row) if not c), len(row)) for row in correct.tolist()) / 4
    assert report.teacher_forced_tau_exact == pytest.approx(brute) == pytest.approx(2.5)
    assert report.teacher_forced_tau_simulated != pytest.approx(report.teacher_forced_tau_exact)
    # The mistake (every hit counted) would give 1 + 9/4.
    assert report.teacher_forced_tau_exact != pytest.approx(1 + int(correct.sum()) / 4)


def test_teacher_forced_scores_every_anchor_of_the_continuation(decoder):
    prompt = PROMPTS[0]
    greedy = decoder.greedy(prompt, 10, eos=None)
    anchors, drafted, correct, counted, _ = decoder.teacher_forced(prompt, greedy)
    assert anchors.tolist() == list(range(len(prompt), len(prompt) + len(greedy) - 1))
    # Slot k of the block at anchor a is labelled when a + k is inside the sequence.
    end = len(prompt) + len(greedy)
    assert counted.tolist() == [[a + k < end for k in range(1, BLOCK)] for a in anchors.tolist()]


def test_a_drafter_that_does_not_fit_the_target_is_refused(tmp_path):
    drafter = Drafter.load(export_drafter(tmp_path / "d"))
    config = transformers.Qwen3Config(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=64,
                                      num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=16)
    with pytest.raises(SpeculativeError, match=r"target_layer_ids \[2\] outside the target's 2 layers"):
        SpeculativeDecoder(transformers.Qwen3ForCausalLM(config), drafter)


def test_an_export_with_a_renamed_tensor_is_refused(tmp_path):
    from safetensors.torch import load_file, save_file

    directory = export_drafter(tmp_path / "d")
    tensors = load_file(str(directory / "model.safetensors"))
    tensors["layers.0.self_attn.qproj.weight"] = tensors.pop("layers.0.self_attn.q_proj.weight")
    save_file(tensors, str(directory / "model.safetensors"))
    with pytest.raises(DrafterError, match="`layers.0.self_attn.q_proj.weight` is missing"):
        Drafter.load(directory)
