"""Long conversations: a multi-turn, agent-style workload against jmoe's server with and without prefix reuse and
against `transformers serve` (issue #57): time to first token per turn, prompt tokens computed, expert bytes moved
per computed prompt token; and how a decoding row fares while another request's long prompt prefills.

  JAX_PLATFORMS=cpu python -m bench.conversation [--cache 4] [--context 2048] [--conversations 4] [--turns 3]
                                                 [--system-tokens 1500] [--rounds 2]
                                                 [--engines jmoe,jmoe-no-reuse,transformers]
  JAX_PLATFORMS=cpu python -m bench.conversation --smoke   # toy sizes (2 conversations of 2 turns, one round,
                                                           # context 512, jmoe with reuse only), answering once its
                                                           # first programs exist

The model is bench.decode's random 215M Mixtral (8 layers, 16 experts, top-2, vocabulary 8192), written once into
--workdir with a tokenizer of one character per token id (U+4E00 on): the random model's replies are any ids, which
no trained tokenizer turns into text and back unchanged, so both servers are sent text that is exactly the token ids
meant. Every conversation starts with the same system prompt (random ids) and a user message of its own; each next
turn's prompt is the previous prompt, the reply and a new user message; replies are greedy, streamed. The
conversations run their turns together: every conversation's turn t is sent at once, the next turn when all have
answered. Each engine is a fresh server process, the engines alternate over --rounds; figures are medians over
conversations and rounds. Per turn: time to first token, prompt tokens and those computed (the rest reused, jmoe's
usage.prompt_tokens_details.cached_tokens), the expert bytes jmoe copied to the device (/metrics) from the turn's
start until every conversation had its first token, per computed prompt token. Replies are compared with jmoe
without reuse (a fresh server's answer). Then, on each server, one request decodes while another sends a
--long-prompt token prompt: the decoding stream's token gaps while that prompt prefills, next to the server's step
times (jmoe's jmoe:step_seconds by kind).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import NamedTuple

import httpx

from bench.compare_cpu import load_average, load_warning, quiet_start_load
from bench.decode import COMPARE_MODELS
from bench.helpers.common import (add_smoke_argument, smoke_run, smoke_spec, write_random_checkpoint, write_result,
                                  write_smoke_checkpoint)
from bench.helpers.servers import Server, complete, jmoe_command, metric_delta, transformers_command

# Each engine and its server flags (None: transformers serve).
ENGINES = {"jmoe": (), "jmoe-no-reuse": ("--no-prefix-reuse",), "transformers": None}
REFERENCE = "jmoe-no-reuse"  # replies are compared with this engine's: every prompt prefilled from its first token
FIRST_CHAR = 0x4E00  # token id i is the character FIRST_CHAR + i (CJK ideographs: 20,992 single code points)
FIRST_WORD_ID = 3  # prompts use ids from here on: Mixtral's configs give 0-2 to padding, BOS and EOS
MODEL_NAME = "conversation"
MOVED = "jmoe:expert_cache_host_to_device_bytes_total"
FINISHED = "jmoe:requests_finished_total"
KV_PAGE = 256  # transformers serve's tokens per KV cache page
DECODER_PROMPT = 16  # tokens of the prompt of the request that decodes through the long prefill
DECODING_BEFORE = 4  # tokens that request has generated before the long prompt is sent
TRIES = 3  # of that measurement, when the long prompt went out too late (decode_during_prefill)
WARM_PROMPT = list(range(100, 108))  # each server's first completion, before anything is measured
# A smoke run starts one server, jmoe's with reuse (each server is 10-15 s of the test suite's time): bench.serve's
# smoke starts transformers serve, tests/test_bench_conversation.py checks that it reads this bench's tokenizer as
# jmoe does, and tests/test_serve_engine.py serves without reuse; the report compares the replies with the first
# engine's when jmoe-no-reuse is not run.
# Its context leaves the request that decodes through the long prompt's prefill ~500 tokens (0.25 s on a Zen 5 guest):
# with 112 (context 128) it ran out before the long prompt went out in 2 of 3 runs beside two busy processes.
SMOKE = dict(conversations=2, turns=2, system_tokens=24, user_tokens=(4, 8), reply_tokens=4, long_prompt=40,
             context=512, max_batch=2, rounds=1, engines=["jmoe"])


# ---- the workload ----------------------------------------------------------------------------------------

class Workload(NamedTuple):
    """Token ids: the shared system prompt, every conversation's user messages ([conversation][turn]), and the two
    prompts of the decode-during-prefill measurement."""

    system: list[int]
    users: list[list[list[int]]]
    decoder_prompt: list[int]
    long_prompt: list[int]


def build_workload(seed: int, conversations: int, turns: int, system_tokens: int, user_tokens: tuple[int, int],
                   long_prompt: int, vocab_size: int) -> Workload:
    """Random ids from `seed`: user messages of user_tokens (inclusive range) tokens each."""
    rng = random.Random(seed)
    ids = lambda n: [rng.randrange(FIRST_WORD_ID, vocab_size) for _ in range(n)]  # noqa: E731
    return Workload(ids(system_tokens), [[ids(rng.randint(*user_tokens)) for _ in range(turns)]
                                         for _ in range(conversations)], ids(DECODER_PROMPT), ids(long_prompt))


def first_prompts(workload: Workload) -> list[list[int]]:
    return [workload.system + users[0] for users in workload.users]


def next_prompt(prompt: list[int], reply: list[int], user: list[int]) -> list[int]:
    """The conversation so far, as a chat client resends it: the last prompt, its reply, the new user message."""
    return prompt + reply + user


def longest_prompt(workload: Workload, reply_tokens: int) -> int:
    """The most tokens any turn's prompt can have (every earlier reply at full length)."""
    turns = len(workload.users[0])
    return len(workload.system) + max(map(sum, ([len(u) for u in users] for users in workload.users))) + (
        turns - 1) * reply_tokens


def as_text(ids: list[int]) -> str:
    return "".join(chr(FIRST_CHAR + i) for i in ids)


def as_ids(text: str) -> list[int]:
    return [ord(c) - FIRST_CHAR for c in text]


# ---- the model -------------------------------------------------------------------------------------------

def write_model(directory: Path, smoke: bool) -> Path:
    """bench.decode's random Mixtral (at smoke size, for jmoe's server only, in a smoke run) with the
    one-character-per-id tokenizer."""
    # The smoke writer keeps only the keys given: BOS and EOS as transformers' Mixtral config has them (FIRST_WORD_ID).
    spec = smoke_spec(COMPARE_MODELS["mixtral"], bos_token_id=1, eos_token_id=2) if smoke else COMPARE_MODELS["mixtral"]
    (write_smoke_checkpoint if smoke else write_random_checkpoint)(directory, **spec)
    write_character_tokenizer(directory, spec["vocab_size"])
    return directory


def write_character_tokenizer(directory: Path, vocab_size: int) -> None:
    """tokenizer.json mapping id i to the character FIRST_CHAR + i and back: the text split into characters, each
    written byte-level (GPT-2's byte alphabet) as llguidance, jmoe's grammar engine, needs to read a tokenizer; and the
    tokenizer_config.json that has transformers read it as it is."""
    from tokenizers import Regex, Tokenizer, decoders, pre_tokenizers
    from tokenizers.models import WordLevel

    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    vocab = {byte_level.pre_tokenize_str(chr(FIRST_CHAR + i))[0][0]: i for i in range(vocab_size)}
    tokenizer = Tokenizer(WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex("."), behavior="isolated"),
                                                       byte_level])
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}))


# ---- one server ------------------------------------------------------------------------------------------

def start_server(engine: str, args, log: Path) -> Server:
    """A fresh server of `engine`: jmoe with every program compiled first (none compiles behind a measured turn;
    the programs come from the run's compilation cache after the first start), transformers with its continuous
    batching and a KV cache of a context's pages per row."""
    if ENGINES[engine] is None:
        pages = args.max_batch * -(-args.context // KV_PAGE)
        command = lambda port: transformers_command(port, args.model, pages)  # noqa: E731
        return Server("transformers", command, log, str(args.model), engine)
    # A smoke run answers once the first programs exist: compiling all of them first was most of its time.
    flags = (*(() if args.smoke else ("--compile-all-first",)), "--compile-cache", str(args.workdir / "compile_cache"),
             *ENGINES[engine])
    command = lambda port: jmoe_command(port, args.model, MODEL_NAME, args.max_batch, args.context,  # noqa: E731
                                        args.cache, flags)
    return Server("jmoe", command, log, MODEL_NAME, engine)


def jmoe_metrics(server: Server) -> dict:
    return server.metrics() if server.kind == "jmoe" else {}


def settled_metrics(server: Server, before: dict, requests: int, timeout: float = 10) -> dict:
    """jmoe's /metrics once the `requests` answered since `before` are counted: a client can read its last chunk
    before the engine's thread has counted the request's tokens."""
    deadline = time.monotonic() + timeout
    while True:
        after = jmoe_metrics(server)
        if not after or metric_delta(before, after, FINISHED) >= requests or time.monotonic() > deadline:
            return after
        time.sleep(0.01)


def run_turn(server: Server, clients: list[httpx.Client], prompts: list[list[int]], args) -> dict:
    """Every conversation's prompt at once, one thread each; /metrics read before, once every conversation has its
    first token (the turn's prefills done) and after."""
    first_tokens, lock, prefilled = [0], threading.Lock(), threading.Event()

    def on_token(n: int) -> bool:
        if n == 1:
            with lock:
                first_tokens[0] += 1
                if first_tokens[0] == len(prompts):
                    prefilled.set()
        return True

    before = jmoe_metrics(server)
    with ThreadPoolExecutor(len(prompts)) as pool:
        futures = [pool.submit(complete, client, server, as_text(prompt), args.reply_tokens, args.request_timeout,
                               None, on_token) for client, prompt in zip(clients, prompts)]
        while not prefilled.wait(0.01) and not any(f.done() and f.exception() for f in futures):
            pass
        at_first_tokens = jmoe_metrics(server)
        answers = [future.result() for future in futures]
    after = settled_metrics(server, before, len(prompts))
    for prompt, answer in zip(prompts, answers):
        if answer["prompt_tokens"] not in (None, len(prompt)):  # the tokenizer must give the server our ids
            raise RuntimeError(f"{server.engine} read {answer['prompt_tokens']} prompt tokens, sent {len(prompt)}")
    computed = [len(p) - a["cached_tokens"] for p, a in zip(prompts, answers)]
    moved = metric_delta(before, at_first_tokens, MOVED) if MOVED in after else None
    return {"ttft": [a["ttft"] for a in answers], "prompt_tokens": [len(p) for p in prompts], "computed": computed,
            "replies": [a["text"] for a in answers], "moved_prefilling": moved,
            "moved_per_computed": moved / sum(computed) if moved is not None and sum(computed) else None,
            "reused_metric": metric_delta(before, after, "jmoe:prompt_tokens_reused_total") if after else None,
            "computed_metric": metric_delta(before, after, "jmoe:prompt_tokens_computed_total") if after else None}


def converse(server: Server, workload: Workload, args) -> list[dict]:
    """Every conversation's turns, each turn run_turn's record."""
    clients = [httpx.Client() for _ in workload.users]
    try:
        prompts, turns = first_prompts(workload), []
        for turn in range(len(workload.users[0])):
            if turn:
                prompts = [next_prompt(prompt, as_ids(reply), users[turn])
                           for prompt, reply, users in zip(prompts, turns[-1]["replies"], workload.users)]
            turns.append(run_turn(server, clients, prompts, args))
        return turns
    finally:
        for client in clients:
            client.close()


def decode_during_prefill(server: Server, workload: Workload, args) -> dict:
    """One request decodes (streamed) while the long prompt is sent: the decoding stream's gaps between tokens that
    overlap the long prompt's prefill (from sending it to its first token), and the server's step times then. Tried
    again (TRIES in all) when the long prompt went out only after the decoding request had ended: this process was
    late, not the server."""
    # A program still compiling behind the first requests would make the long prompt wait for it, and the decoding
    # request could run out of room first (a smoke run's context is 512): every step here runs a compiled program.
    server.wait_compiled(args.request_timeout)
    for attempt in range(TRIES):
        # Each try's long prompt starts with another token: no row holds it as a prefix from the try before.
        long_prompt = workload.long_prompt[attempt:] + workload.long_prompt[:attempt]
        measured = decode_while_sending(server, workload.decoder_prompt, long_prompt, args)
        if measured is not None:
            return measured
    raise RuntimeError(f"{server.engine}: in {TRIES} tries the long prompt went out only after the decoding request "
                       f"had ended; raise --context")


def decode_while_sending(server: Server, decoder_prompt: list[int], long_prompt: list[int], args) -> dict | None:
    """decode_during_prefill's measurement, once; None when the decoding request ended before the long prompt was
    sent. The server's step times are read from before the decoding request starts: read between its tokens and the
    long prompt, /metrics (answered between the server's steps, on a busy machine in up to 0.7 s) let a smoke
    model's request decode its whole room (~500 tokens in 0.25 s) before the long prompt went out."""
    decoding, prefilled = threading.Event(), threading.Event()

    def on_token(n: int) -> bool:
        if n >= DECODING_BEFORE:
            decoding.set()
        return not prefilled.is_set()

    room = args.context - len(decoder_prompt)
    with httpx.Client() as decoder_client, httpx.Client() as long_client, ThreadPoolExecutor(1) as pool:
        before = jmoe_metrics(server)
        decoder = pool.submit(complete, decoder_client, server, as_text(decoder_prompt), room, args.request_timeout,
                              None, on_token)
        if not decoding.wait(args.request_timeout):
            raise RuntimeError(f"{server.engine}: the decoding request produced no {DECODING_BEFORE} tokens")
        long = complete(long_client, server, as_text(long_prompt), 1, args.request_timeout)
        prefilled.set()
        after = jmoe_metrics(server)
        arrivals = decoder.result()["arrivals"]
    start, end = long["began"], long["arrivals"][0]
    if arrivals[-1] < start:
        return None
    if arrivals[-1] < end:
        raise RuntimeError(f"{server.engine}: the decoding request ended ({len(arrivals)} tokens of {room}) "
                           f"{arrivals[-1] - start:.3f} s after the long prompt was sent, before it was prefilled "
                           f"({end - start:.3f} s); raise --context")
    steps = {kind: (metric_delta(before, after, f'jmoe:step_seconds_sum{{kind="{kind}"}}'),
                    metric_delta(before, after, f'jmoe:step_seconds_count{{kind="{kind}"}}'))
             for kind in ("prefill", "decode")} if after else {}
    return {"prefill_s": end - start, "gaps": gaps_overlapping(arrivals, start, end), "steps": steps}


def gaps_overlapping(arrivals: list[float], start: float, end: float) -> list[float]:
    """The gaps between consecutive `arrivals` (times, sorted, one at or before `start` and one at or after `end`)
    that overlap [start, end]: from the last arrival at or before `start` to the first at or after `end`."""
    first = max(i for i, t in enumerate(arrivals) if t <= start)
    last = min(i for i, t in enumerate(arrivals) if t >= end)
    return [b - a for a, b in zip(arrivals[first:last], arrivals[first + 1:last + 1])]


def measure(engine: str, args, workload: Workload, round_index: int) -> dict:
    server = start_server(engine, args, args.workdir / f"{engine}_{round_index}.log")
    try:
        ready = server.wait_ready(args.start_timeout, as_text(WARM_PROMPT))
        return {"ready_s": ready, "turns": converse(server, workload, args),
                "during_prefill": decode_during_prefill(server, workload, args)}
    finally:
        server.stop()


# ---- the report ------------------------------------------------------------------------------------------

def fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def median_or_none(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def turn_rows(engine: str, runs: list[dict]) -> list[str]:
    """The per-turn table's rows of one engine: medians over conversations and rounds."""
    rows = []
    for turn in range(len(runs[0]["turns"])):
        records = [run["turns"][turn] for run in runs]
        each = lambda key: [v for r in records for v in r[key]]  # noqa: E731
        moved = median_or_none([r["moved_prefilling"] for r in records])
        per_token = median_or_none([r["moved_per_computed"] for r in records])
        reused, computed = (median_or_none([r[key] for r in records]) for key in ("reused_metric", "computed_metric"))
        rows.append(f"| {engine} | {turn + 1} | {statistics.median(each('prompt_tokens')):.0f} | "
                    f"{statistics.median(each('computed')):.0f} | {1e3 * statistics.median(each('ttft')):.0f} | "
                    f"{ttft_ratio(runs, turn):.2f}x | {fmt(moved and moved / 1e6, ',.1f')} | "
                    f"{fmt(per_token and per_token / 1e3, ',.1f')} | "
                    f"{fmt(reused, ',.0f')} / {fmt(computed, ',.0f')} |")
    return rows


def ttft_ratio(runs: list[dict], turn: int) -> float:
    """A turn's time to first token over turn 1's, per conversation, median over conversations and rounds."""
    return statistics.median(t / first for run in runs for t, first in zip(run["turns"][turn]["ttft"],
                                                                          run["turns"][0]["ttft"]))


def median_ttft(runs: list[dict], turn: int) -> float:
    return statistics.median(t for run in runs for t in run["turns"][turn]["ttft"])


def turn_two_check(runs: dict) -> str:
    """The check of issue #57: turn 2 with reuse against turn 1, on the same server (whose turn 1 may itself have
    reused the system prompt another conversation was prefilling) and against turn 1 without reuse."""
    ratio = ttft_ratio(runs["jmoe"], 1)
    line = (f"jmoe with prefix reuse, turn 2 / turn 1 time to first token: **{ratio:.2f}x** on the same server "
            f"(target <= 0.3x: {'met' if ratio <= 0.3 else 'not met'})")
    if REFERENCE in runs:
        fresh = median_ttft(runs["jmoe"], 1) / median_ttft(runs[REFERENCE], 0)
        line += f"; **{fresh:.2f}x** of {REFERENCE}'s turn 1 (medians)"
    return line + "."


def replies_agreement(runs: dict, engine: str, reference: str) -> str:
    """How many of `engine`'s replies equal `reference`'s (same round, conversation and turn), and the first that
    does not."""
    pairs = [((r, c, t), reply, other)
             for r, (mine, theirs) in enumerate(zip(runs[engine], runs[reference]))
             for t, (turn, ref_turn) in enumerate(zip(mine["turns"], theirs["turns"]))
             for c, (reply, other) in enumerate(zip(turn["replies"], ref_turn["replies"]))]
    differing = [where for where, reply, other in pairs if reply != other]
    line = f"{engine}: {len(pairs) - len(differing)} of {len(pairs)} replies identical to {reference}'s"
    if differing:
        r, c, t = differing[0]
        line += f" (the first that differs: round {r + 1}, conversation {c + 1}, turn {t + 1})"
    return line + "."


def prefill_gap_row(engine: str, runs: list[dict]) -> str:
    """The decode-during-prefill table's row of one engine: medians over rounds, the largest gap of all rounds."""
    records = [run["during_prefill"] for run in runs]
    largest = max(max(r["gaps"]) for r in records)
    mean_step = lambda kind: median_or_none([r["steps"][kind][0] / r["steps"][kind][1]  # noqa: E731
                                             for r in records if r["steps"] and r["steps"][kind][1]])
    prefill_step, decode_step = mean_step("prefill"), mean_step("decode")
    bound = prefill_step + decode_step if prefill_step is not None and decode_step is not None else None
    prefill_steps = median_or_none([r["steps"]["prefill"][1] for r in records if r["steps"]])
    return (f"| {engine} | {statistics.median(r['prefill_s'] for r in records):.2f} | "
            f"{statistics.median(len(r['gaps']) for r in records):.0f} | "
            f"{1e3 * statistics.median(statistics.median(r['gaps']) for r in records):.1f} | {1e3 * largest:.1f} | "
            f"{fmt(prefill_steps, '.0f')} | {fmt(prefill_step and 1e3 * prefill_step, '.1f')} | "
            f"{fmt(decode_step and 1e3 * decode_step, '.1f')} | {fmt(bound and largest / bound, '.2f')} |")


def turns_section(args, workload: Workload, runs: dict) -> list[str]:
    """The settings, the per-turn table, the turn-2 check and the replies' agreement."""
    lines = [f"Model: bench.decode's random Mixtral ({'smoke size' if args.smoke else '215M'}, `{args.model}`), "
             f"float32, a one-character-per-id tokenizer; jmoe `--cache {args.cache}` `--context {args.context}` "
             f"`--max-batch {args.max_batch}`{'' if args.smoke else ' `--compile-all-first`'}; transformers serve "
             f"`--continuous-batching`. {args.conversations} conversations of {args.turns} turns, run together; "
             f"system prompt {len(workload.system)} tokens, user messages {args.user_tokens[0]}-{args.user_tokens[1]} "
             f"tokens, replies of up to {args.reply_tokens} tokens, greedy, streamed (seed {args.seed}); "
             f"{args.rounds} round(s), engines alternated, each a fresh server.", "",
             "| engine | turn | prompt tokens | computed | TTFT (ms) | vs turn 1 | MB moved while prefilling | "
             "kB per computed token | /metrics reused / computed |",
             "|---|---|---|---|---|---|---|---|---|"]
    for engine in runs:
        lines += turn_rows(engine, runs[engine])
    lines += ["", "Computed: prompt tokens less those the server reused (usage.prompt_tokens_details.cached_tokens; "
                  "transformers reports none, so all of its count as computed). MB moved: jmoe's expert bytes copied "
                  "to the device from the turn's start until every conversation had its first token (decode steps "
                  "of conversations already answering included), per computed prompt token of the turn. /metrics: "
                  "the counters' growth over the whole turn."]
    if "jmoe" in runs and args.turns > 1:
        lines += ["", turn_two_check(runs)]
    reference = REFERENCE if REFERENCE in runs else next(iter(runs))
    return lines + [""] + [replies_agreement(runs, engine, reference) for engine in runs if engine != reference]


def decoding_section(workload: Workload, runs: dict) -> list[str]:
    """The decode-during-prefill table."""
    return [f"A request decoding while another sends a {len(workload.long_prompt)}-token prompt (its "
            f"{DECODER_PROMPT}-token prompt unrelated): the decoding stream's gaps between tokens that overlap the "
            f"long prompt's prefill (from sending it to its first token); jmoe's mean step times from the decoding "
            f"request's start to the long prompt's first token (/metrics jmoe:step_seconds, by kind; the decoding "
            f"request's own prefill is one of the prefill steps). Bound: one prefill step and one decode step.", "",
            "| engine | long prompt's prefill (s) | gaps | median gap (ms) | largest gap (ms) | prefill steps | "
            "prefill step (ms) | decode step (ms) | largest gap / bound |",
            "|---|---|---|---|---|---|---|---|---|"] + [prefill_gap_row(engine, runs[engine]) for engine in runs]


def report(args, workload: Workload, runs: dict, start_load: float, conditions: str) -> str:
    readiness = "; ".join(f"{engine} " + ", ".join(f"{run['ready_s']:.1f}" for run in runs[engine]) + " s"
                          for engine in runs)
    lines = [load_warning(start_load) + conditions, "", *turns_section(args, workload, runs), "",
             *decoding_section(workload, runs), "",
             f"Ready (start to first answered completion), round by round: {readiness}."]
    return "\n".join(lines) + "\n"


# ---- the run ---------------------------------------------------------------------------------------------

def parse_args(argv) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cache", type=int, default=4, help="jmoe: experts per MoE layer on the device (of 16)")
    parser.add_argument("--context", type=int, default=2048, help="tokens per row, prompt and reply")
    parser.add_argument("--max-batch", type=int, default=4, help="rows (at least --conversations: a conversation's "
                        "next turn finds its prefix in a row it held)")
    parser.add_argument("--conversations", type=int, default=4)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--system-tokens", type=int, default=1500)
    parser.add_argument("--user-tokens", type=lambda s: tuple(int(x) for x in s.split("-")), default=(50, 100),
                        help="a user message's tokens, MIN-MAX")
    parser.add_argument("--reply-tokens", type=int, default=32, help="max_tokens of every reply")
    parser.add_argument("--long-prompt", type=int, default=2000, help="tokens of the prompt sent while a row decodes")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--engines", type=lambda s: s.split(","), default=list(ENGINES))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--start-timeout", type=float, default=1800, help="seconds a server may take to answer "
                        "first (compiling every program)")
    parser.add_argument("--request-timeout", type=float, default=600)
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/jmoe_bench_conversation"),
                        help="the checkpoint, the servers' compilation cache and logs")
    parser.add_argument("--out", default="conversation_cpu.md")
    parser.add_argument("--allow-load", action="store_true", help="write the report even if the machine is busy")
    add_smoke_argument(parser)
    args = parser.parse_args(argv)
    if set(args.engines) - set(ENGINES) or not args.engines:
        parser.error(f"--engines: choose from {', '.join(ENGINES)}; found {','.join(args.engines)}")
    if args.smoke:
        vars(args).update(SMOKE)
    return args


def check_sizes(args, workload: Workload) -> None:
    """Every prompt and reply fits a row; both requests of the decode-during-prefill measurement hold a row."""
    longest = longest_prompt(workload, args.reply_tokens) + args.reply_tokens
    if longest > args.context or len(workload.long_prompt) + 1 > args.context:
        raise SystemExit(f"bench.conversation: the last turn needs up to {longest} tokens and the long prompt "
                         f"{len(workload.long_prompt) + 1}, over --context {args.context}")
    if args.max_batch < 2:
        raise SystemExit("bench.conversation: --max-batch must be at least 2 (a decoding row and the long prompt)")


def main(argv=None) -> None:
    args = parse_args(argv)
    with smoke_run(args):
        start_load = quiet_start_load("bench.conversation", args.allow_load or args.smoke)
        args.workdir.mkdir(parents=True, exist_ok=True)
        args.model = write_model(args.workdir / ("mixtral-smoke" if args.smoke else "mixtral-215m"), args.smoke)
        workload = build_workload(args.seed, args.conversations, args.turns, args.system_tokens, args.user_tokens,
                                  args.long_prompt, COMPARE_MODELS["mixtral"]["vocab_size"])
        check_sizes(args, workload)
        began = time.monotonic()
        runs = {engine: [] for engine in args.engines}
        for round_index in range(args.rounds):
            for engine in args.engines:
                print(f"[{time.monotonic() - began:5.0f} s] round {round_index + 1}: {engine}", file=sys.stderr,
                      flush=True)
                runs[engine].append(measure(engine, args, workload, round_index))
        conditions = (f"Load average {start_load:.2f} at the start, {load_average():.2f} at the end; whole run "
                      f"{time.monotonic() - began:.0f} s.")
        path = write_result(args.out, "Long conversations: prefix reuse, time to first token per turn",
                            report(args, workload, runs, start_load, conditions))
        print(path.read_text())


if __name__ == "__main__":
    main()
