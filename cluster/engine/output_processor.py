"""Output processing: what each step appended to a request, as the ``RequestOutput`` a caller
gets (detokenized, stop strings found, logprobs in the OpenAI form).

It keeps one state per live request. ``find_stop`` runs first: it detokenizes the new tokens
and, where a stop string completes, cuts the output at the token that completed it and says
which string; the engine then finishes the request in the scheduler. ``build`` then makes the
output (whole so far, or only what the step added for a delta stream) and forgets a finished
request.
"""

from __future__ import annotations

from dataclasses import dataclass

from cluster.engine.detokenizer import IncrementalDetokenizer
from cluster.shared.outputs import CompletionOutput, Logprob, RequestOutput, RequestTimes, TokenLogprobs, Usage
from cluster.shared.request import Request, RequestStatus
from cluster.shared.sampled import PromptLogprobs, SampledTokens


@dataclass
class _OutputState:
    detokenizer: IncrementalDetokenizer | None
    logprobs: list[TokenLogprobs] | None  # so far (None: not asked for, or deltas only)
    num_sent_tokens: int = 0
    cumulative: bool = True
    # Prompt logprobs so far, from the first token's None on (None: not asked for); a delta
    # stream gets them whole with its first output.
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    prompt_logprobs_sent: bool = False


class OutputProcessor:
    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self._states: dict[str, _OutputState] = {}

    def add(self, request: Request, cumulative: bool) -> None:
        """Start a request's output; ``cumulative=False``: each output carries only the step's delta."""
        params = request.sampling_params
        detok = None
        if self.tokenizer is not None:
            detok = IncrementalDetokenizer(self.tokenizer, request.prompt_token_ids, params.stop,
                                           params.skip_special_tokens, params.min_tokens,
                                           params.include_stop_str_in_output)
        logprobs = [] if params.logprobs is not None and cumulative else None
        prompt_logprobs = [None] if params.prompt_logprobs is not None else None
        self._states[request.request_id] = _OutputState(detok, logprobs, cumulative=cumulative,
                                                        prompt_logprobs=prompt_logprobs)

    def drop(self, request_id: str) -> None:
        self._states.pop(request_id, None)

    def add_prompt_logprobs(self, computed: dict[str, PromptLogprobs]) -> None:
        """Append what a step computed of requests' prompt logprobs; positions already held
        (a prompt recomputed after a preemption) are skipped."""
        for rid, part in computed.items():
            state = self._states.get(rid)
            if state is None or state.prompt_logprobs is None:
                continue
            skip = len(state.prompt_logprobs) - part.first_position
            if skip >= 0:
                state.prompt_logprobs.extend(self._logprobs(entry) for entry in part.entries[skip:])

    def find_stop(self, request: Request) -> str | None:
        """Detokenize the tokens the step appended; if a stop string completes among them, cut the
        output after the token that completed it (even inside a run of accepted drafts) and return it."""
        state = self._states[request.request_id]
        detok = state.detokenizer
        if detok is None:
            return None
        new_ids = request.output_token_ids[state.num_sent_tokens:]
        # The token that stopped the request (EOS, a stop id) adds no text unless asked to.
        num_texts = len(new_ids)
        if (request.status == RequestStatus.FINISHED_STOPPED and new_ids and request.is_stop_token(new_ids[-1])
                and not request.sampling_params.include_stop_str_in_output):
            num_texts -= 1
        for j, token in enumerate(new_ids[:num_texts]):
            stop = detok.add_token(token)
            if stop is not None:
                request.truncate_output(state.num_sent_tokens + j + 1)
                return stop
        return None

    def build(self, request: Request, sampled: SampledTokens) -> RequestOutput:
        """The request's output after this step (``find_stop`` having run); a finished request is forgotten."""
        state = self._states[request.request_id]
        new_ids = request.output_token_ids[state.num_sent_tokens:]
        delta_logprobs = None
        if request.sampling_params.logprobs is not None and sampled.logprobs is not None:
            # A stop (token or string) inside a run of accepted drafts cut the tokens: cut their logprobs alike.
            delta_logprobs = [self._logprobs(entry) for entry in sampled.logprobs[: len(new_ids)]]
            if state.logprobs is not None:
                state.logprobs.extend(delta_logprobs)
        state.num_sent_tokens = request.num_output_tokens
        finished = request.is_finished
        if finished:
            del self._states[request.request_id]
        detok = state.detokenizer
        delta_text = detok.release(finished) if detok is not None else ""
        if state.cumulative:
            text = detok.released_text if detok is not None else ""
            token_ids = list(request.output_token_ids)
        else:
            text, token_ids = delta_text, new_ids
        completion = CompletionOutput(
            index=0,
            text=text,
            token_ids=token_ids,
            finish_reason=request.finish_reason,
            stop_reason=request.stop_reason,
            logprobs=state.logprobs if state.cumulative else delta_logprobs,
            delta_text=delta_text,
            delta_token_ids=new_ids,
            delta_logprobs=delta_logprobs,
        )
        usage = Usage(request.num_prompt_tokens, request.num_output_tokens, request.num_cached_tokens)
        times = RequestTimes(request.arrival_time, request.scheduled_time, request.first_token_time)
        prompt_logprobs = None
        if state.prompt_logprobs is not None and (state.cumulative or not state.prompt_logprobs_sent):
            prompt_logprobs, state.prompt_logprobs_sent = state.prompt_logprobs, True
        return RequestOutput(request.request_id, request.prompt, request.prompt_token_ids, [completion],
                             finished, usage, times, prompt_logprobs, request.sampling_params.max_tokens,
                             request.num_preemptions, request.spec_decode)

    def _logprobs(self, entry: tuple[list[int], list[float], int]) -> TokenLogprobs:
        ids, values, rank = entry
        result: TokenLogprobs = {}
        for position, (token, value) in enumerate(zip(ids, values)):
            token_rank = rank if position == 0 else position
            decoded = self.tokenizer.decode([token]) if self.tokenizer is not None else None
            result.setdefault(token, Logprob(value, token_rank, decoded))
        return result
