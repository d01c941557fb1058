"""What a step hands the caller of `serve_jax.engine.Engine.step` per sample
(`serve_jax.request_output`): incremental work, snapshots that later tokens do not change,
stop strings cut across steps. Pure Python, no engine."""

from __future__ import annotations

import pytest

from serve_jax.interface import Request, RequestStatus, TokenLogprobs
from serve_jax.request_output import History, SampleState
from serve_jax.sampling import SamplingParams
from serve_jax.tokenizer import ByteTokenizer


class ReadCountingList(list):
    """A list that counts the items read through slices and iteration (the history copies)."""

    def __init__(self, *args):
        super().__init__(*args)
        self.items_read = 0

    def __getitem__(self, i):
        out = super().__getitem__(i)
        self.items_read += len(out) if isinstance(i, slice) else 1
        return out

    def __iter__(self):
        self.items_read += len(self)
        return super().__iter__()


def _sample(params: SamplingParams, prompt: str = "hi") -> tuple[SampleState, ByteTokenizer]:
    tok = ByteTokenizer()
    ids = tok.encode(prompt)
    req = Request("r", ReadCountingList(ids), params.max_tokens, 0.0)
    req.output_token_ids = ReadCountingList()
    req.token_times = ReadCountingList()
    state = SampleState(req, params, tok.decoder(ids), "r", 0, ReadCountingList())
    return state, tok


def _generate(state: SampleState, tok: ByteTokenizer, text: str):
    """Feeds ``text`` one byte-token a step, as the engine does; yields each step's output."""
    req, ids = state.request, tok.encode(text)[1:]
    for i, t in enumerate(ids):
        req.output_token_ids.append(t)
        req.token_times.append(float(i))
        state.logprobs.append(TokenLogprobs(-0.5, (t,), (-0.5,)))
        last = i == len(ids) - 1
        if last:
            req.status = RequestStatus.FINISHED_LENGTH
        if state.advance_text(last) and not last:
            req.status = RequestStatus.FINISHED_STOPPED
            last = True
        yield state.emit(last, True)
        if last:
            return


def test_a_step_reads_what_is_new_not_the_whole_history():
    """Over n steps the histories are read O(n) items in all (copying them every step read
    n^2 / 2: 80,000 for these 400 tokens)."""
    state, tok = _sample(SamplingParams(max_tokens=400, stop=["never"]))
    outs = list(_generate(state, tok, "ab" * 200))
    assert len(outs) == 400
    req = state.request
    reads = {
        "ids": req.output_token_ids.items_read,
        "logprobs": state.logprobs.items_read,
        "times": req.token_times.items_read,
        "prompt": req.prompt_token_ids.items_read,
    }
    assert all(n <= 3 * 400 for n in reads.values()), reads
    assert outs[-1].text == "ab" * 200 and outs[-1].finished


def test_outputs_are_snapshots_of_their_step():
    state, tok = _sample(SamplingParams(max_tokens=10))
    outs = list(_generate(state, tok, "héllo"))  # é is two byte-tokens
    first, last = outs[0], outs[-1]
    assert first.token_ids == (tok.encode("h")[1],) and first.text == "h"
    assert len(first.metrics.token_times) == 1 and len(first.logprobs) == 1
    assert (
        last.token_ids == tuple(tok.encode("héllo")[1:])
        and last.token_ids == tok.encode("héllo")[1:]
    )
    assert last.text == "héllo" == "".join(o.new_text for o in outs)
    assert tuple(last.metrics.token_times) == (0.0, 1.0, 2.0, 3.0, 4.0, 5.0)
    assert last.token_ids[-2:] == tuple(tok.encode("lo")[1:]) and last.token_ids[-1] == 114
    assert last.prompt_token_ids == tok.encode("hi")
    with pytest.raises(IndexError):
        last.token_ids[6]
    assert History([1, 2, 3], 2) == (1, 2) and History([1, 2, 3], 2) != (1, 2, 3)
    assert repr(History([1, 2], 1)) == "(1,)" and hash(History([4], 1)) == hash((4,))


def test_a_stop_string_across_steps_cuts_the_text_and_holds_back_its_start():
    state, tok = _sample(SamplingParams(max_tokens=50, stop=["STOP", "xyz"]))
    outs = list(_generate(state, tok, "one two STOP three"))
    final = outs[-1]
    assert final.finished and final.finish_reason == "stop"
    assert final.text == "one two " == "".join(o.new_text for o in outs)
    # While "S", "ST", "STO" might begin a stop string they were not sent.
    assert all("S" not in o.new_text for o in outs)
    # An output handed out before the cut keeps its own text.
    assert outs[6].text == "one " and outs[6].text_length == 4  # 3 characters held back
