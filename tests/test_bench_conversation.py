"""bench.conversation's workload and its character tokenizer: the prompts it sends are exactly the token ids it means,
to jmoe, to transformers and to jmoe's grammar engine alike."""

import random

import pytest

from bench.conversation import (FIRST_WORD_ID, as_ids, as_text, build_workload, first_prompts, gaps_overlapping,
                                longest_prompt, next_prompt, replies_agreement, write_character_tokenizer)

pytestmark = pytest.mark.quick
VOCAB = 8192


def test_every_conversation_starts_with_the_system_prompt_and_grows_by_reply_and_message():
    workload = build_workload(seed=3, conversations=4, turns=3, system_tokens=100, user_tokens=(5, 9),
                              long_prompt=50, vocab_size=VOCAB)
    assert workload == build_workload(3, 4, 3, 100, (5, 9), 50, VOCAB)  # the seed fixes it
    assert len(workload.system) == 100 and len(workload.long_prompt) == 50
    assert all(len(users) == 3 and all(5 <= len(u) <= 9 for u in users) for users in workload.users)
    every_id = workload.system + workload.long_prompt + [i for users in workload.users for u in users for i in u]
    assert FIRST_WORD_ID <= min(every_id) and max(every_id) < VOCAB
    prompts, reply = first_prompts(workload), [7, 8, 9]
    assert all(p[:100] == workload.system and p[100:] == users[0] for p, users in zip(prompts, workload.users))
    second = next_prompt(prompts[0], reply, workload.users[0][1])
    assert second == prompts[0] + reply + workload.users[0][1]
    third = next_prompt(second, reply, workload.users[0][2])
    assert len(third) <= longest_prompt(workload, len(reply))


def test_the_character_tokenizer_gives_every_reader_the_ids_back(tmp_path):
    import llguidance
    from transformers import AutoTokenizer

    from jmoe.checkpoint.tokenizer import TextTokenizer

    write_character_tokenizer(tmp_path, VOCAB)
    rng = random.Random(0)
    ids = [rng.randrange(VOCAB) for _ in range(500)] + [0, VOCAB - 1]
    text = as_text(ids)
    assert as_ids(text) == ids
    jmoe_tokenizer, hf_tokenizer = TextTokenizer(tmp_path / "tokenizer.json"), AutoTokenizer.from_pretrained(tmp_path)
    assert jmoe_tokenizer.encode(text) == ids and jmoe_tokenizer.decode(ids) == text
    assert hf_tokenizer(text)["input_ids"] == ids and hf_tokenizer.decode(ids, skip_special_tokens=True) == text
    llguidance.LLTokenizer(jmoe_tokenizer.to_json(), n_vocab=VOCAB)  # as the server builds its grammars' token table


def test_gaps_overlapping_a_window_run_from_the_arrival_before_it_to_the_one_after():
    arrivals = [0.0, 1.0, 2.0, 4.5, 5.0, 6.0]
    assert gaps_overlapping(arrivals, 1.5, 4.8) == [1.0, 2.5, 0.5]
    assert gaps_overlapping(arrivals, 2.0, 4.5) == [2.5]


def test_replies_are_compared_round_by_round_conversation_by_conversation():
    run = lambda *turns: {"turns": [{"replies": list(replies)} for replies in turns]}  # noqa: E731
    runs = {"jmoe-no-reuse": [run(("a", "b"), ("c", "d"))], "jmoe": [run(("a", "b"), ("c", "x"))]}
    assert replies_agreement(runs, "jmoe", "jmoe-no-reuse") == (
        "jmoe: 3 of 4 replies identical to jmoe-no-reuse's (the first that differs: round 1, conversation 2, turn 2).")
