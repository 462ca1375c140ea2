"""How a row becomes the engine's token ids (moerl/tasks/prompting.py): text as it is, chat
messages through the tokenizer's template, and every mismatch refused naming the key."""

import pytest

from moerl.config import parse_config
from moerl.errors import ConfigError
from moerl.models.tiny import build_tokenizer
from moerl.records import Prompt
from moerl.tasks.prompting import encode_prompt, max_new_tokens_for

TEMPLATE = "{% for m in messages %}{{ m['content'] }}={% endfor %}{% if add_generation_prompt %} {% endif %}"


def _rollout(**kw):
    return parse_config({"rollout": kw}).rollout


def _chat_tokenizer():
    tok = build_tokenizer()
    tok.chat_template = TEMPLATE
    return tok


def test_text_rows_encode_as_they_are_and_messages_through_the_template():
    text = Prompt(id="t", task="copy", prompt="copy 12=", answer="12")
    chat = Prompt.model_validate(
        {
            "id": "c",
            "task": "copy",
            "answer": "12",
            "messages": [{"role": "user", "content": "copy 12"}],
        }
    )
    plain, tok = build_tokenizer(), _chat_tokenizer()
    assert encode_prompt(plain, _rollout(), text) == plain.encode("copy 12=")
    assert encode_prompt(tok, _rollout(), text) == plain.encode("copy 12=")  # auto: text stays text
    # the template, with the turn to continue
    assert encode_prompt(tok, _rollout(), chat) == plain.encode("copy 12= ")
    assert encode_prompt(tok, _rollout(chat_template=True), text) == plain.encode("copy 12== ")
    # an async unit's dict
    assert encode_prompt(tok, _rollout(), chat.model_dump()) == encode_prompt(tok, _rollout(), chat)
    assert chat.prompt_text == "copy 12"


def test_what_cannot_be_encoded_faithfully_is_refused_naming_the_key():
    chat = Prompt.model_validate(
        {
            "id": "c",
            "task": "copy",
            "answer": "12",
            "messages": [{"role": "user", "content": "copy 12"}],
        }
    )
    with pytest.raises(ConfigError, match="the policy's tokenizer has no chat template"):
        encode_prompt(build_tokenizer(), _rollout(), chat)
    with pytest.raises(
        ConfigError, match="rollout.chat_template false, but dataset rows give chat messages"
    ):
        encode_prompt(_chat_tokenizer(), _rollout(chat_template=False), chat)
    with pytest.raises(
        ConfigError, match="rollout.chat_template true, but the policy's tokenizer has no chat"
    ):
        encode_prompt(
            build_tokenizer(),
            _rollout(chat_template=True),
            Prompt(id="t", task="copy", prompt="copy 1=", answer="1"),
        )
    for row in (
        {"id": "x", "task": "copy", "answer": "1"},  # neither
        {
            "id": "x",
            "task": "copy",
            "answer": "1",
            "prompt": "p",
            "messages": [{"role": "user", "content": "p"}],
        },
        {"id": "x", "task": "copy", "answer": "1", "messages": [{"role": "robot", "content": "p"}]},
    ):
        with pytest.raises(ValueError):
            Prompt.model_validate(row)


def test_the_total_token_cap_leaves_each_response_what_the_prompt_did_not_take():
    assert max_new_tokens_for(_rollout(max_new_tokens=16), 100) == 16
    assert max_new_tokens_for(_rollout(max_new_tokens=16, max_total_tokens=20), 10) == 10
    assert max_new_tokens_for(_rollout(max_new_tokens=4, max_total_tokens=20), 10) == 4
    with pytest.raises(Exception, match="leaves no room under rollout.max_total_tokens 20"):
        max_new_tokens_for(_rollout(max_total_tokens=20), 20)


def test_chat_rows_for_a_tokenizer_without_a_template_are_refused_before_any_work(tmp_path):
    import json

    from moerl.config import load_config
    from moerl.preflight import preflight

    data = tmp_path / "chat.jsonl"
    data.write_text(
        json.dumps(
            {
                "id": "c",
                "task": "copy",
                "answer": "12",
                "messages": [{"role": "user", "content": "copy 12="}],
            }
        )
        + "\n"
    )
    cfg = load_config(
        "configs/tiny-moe-grpo.yaml", [f"checkpoint.uri={tmp_path / 'ck'}", f"task.dataset={data}"]
    )
    with pytest.raises(
        ConfigError, match="dataset rows give chat messages, but the policy's tokenizer has no chat"
    ):
        preflight(cfg)


def test_a_chat_episode_appends_exactly_what_the_template_renders_for_the_whole_conversation():
    """Token in, token out with a chat template: the prompt, the model's turn and the
    environment's observation (a `tool` message and the next assistant prompt) are the tokens
    the template gives the whole conversation, whether the model closed its turn (end-of-turn
    token) or ran out of tokens (the driver closes it, masked 0)."""
    from moerl.components.rollout.episodes import EpisodeDriver

    tok = build_tokenizer()
    tok.chat_template = (
        "{% for m in messages %}{{ {'user': 'p', 'assistant': 'a', 'tool': 'r', 'system': 'y'}"
        "[m['role']] }} {{ m['content'] }}<eos>{% endfor %}{% if add_generation_prompt %}a {% endif %}"
    )
    cfg = parse_config({"task": {"environment": "tests.support.hostile_environments:Counter"}})
    row = Prompt.model_validate(
        {
            "id": "c",
            "task": "copy",
            "answer": "12",
            "messages": [{"role": "user", "content": "copy 12"}],
        }
    )
    ids = encode_prompt(tok, cfg.rollout, row)
    assert ids == tok.encode("p copy 12<eos>a ", add_special_tokens=False)
    d = EpisodeDriver(cfg, tok, pool=None)
    for closed in (True, False):
        ep = d.episode("k", row.model_dump(), ids, 0, templated=True)
        model = tok.encode("12", add_special_tokens=False) + ([tok.eos_token_id] if closed else [])
        ep.tokens += model
        ep.mask += [1] * len(model)
        obs_ids, _ = d.observation(ep, "3")
        whole = tok.apply_chat_template(
            [
                {"role": "user", "content": "copy 12"},
                {"role": "assistant", "content": "12"},
                {"role": "tool", "content": "3"},
            ],
            add_generation_prompt=True,
            tokenize=True,
        )
        whole = list(whole["input_ids"] if hasattr(whole, "keys") else whole)
        assert ids + model + obs_ids == whole, closed
        assert obs_ids[0] == (
            tok.encode("r", add_special_tokens=False)[0] if closed else tok.eos_token_id
        )
