"""Draft-model speculation: a second, smaller model that shares the main model's
vocabulary guesses the next tokens, and the main model checks them in one pass.

Where prompt lookup (`lookup`) guesses only what the sequence already holds, a draft model
guesses any text: it runs its own greedy decode, a token per pass, on a context of its own
with a sequence per scheduler slot, and the scheduler decodes the guesses after the slot's
next token exactly as it decodes prompt-lookup guesses (`ModelScheduler._accept`): each
token is still sampled from the main model's logits at its position, so the answer is the
same, token for token, and a wrong guess costs the rows of one pass. It pays where the
draft's passes are much cheaper than the main model's and a pass of several rows costs
the main model little more than one: a GPU, with a draft a tenth of the main model's size.

The draft's cells follow the slot's tokens: before each guess the sequence keeps the part
of its cells that still agrees with the slot (all of them while the guesses are
confirmed) and prefills the rest, so a new job prefills its prompt on the draft once,
in the step of its first guess.

The two models must tokenize alike: the same number of tokens, and each token the same
bytes (`vocabulary_difference`); a draft that differs is refused when the model loads.
A guess that fails (the draft's context full, a failed pass) is no guess: the stream goes
on without one, as it would without a draft model.
"""

from __future__ import annotations

from edge_agent.engine.runtime.llama import BatchContext, LlamaModel
from edge_agent.engine.scheduling.steppolicy import common_prefix


def vocabulary_difference(main: LlamaModel, draft: LlamaModel) -> str | None:
    """Why `draft` cannot guess for `main` (their vocabularies differ), or None."""
    if main.n_vocab != draft.n_vocab:
        return f"{draft.n_vocab} tokens against {main.n_vocab}"
    for token in range(main.n_vocab):
        if main.piece(token) != draft.piece(token):
            return f"token {token} is {draft.piece(token)!r}, not {main.piece(token)!r}"
    return None


class DraftModel:
    """The draft model's context, one sequence per scheduler slot, and the tokens each
    sequence holds. Used on the scheduler's thread only."""

    def __init__(self, model: LlamaModel, *, n_seq: int, n_ctx_seq: int, n_batch: int,
                 n_threads: int, flash_attn: int = -1) -> None:
        self.model = model
        self.ctx = BatchContext(model, n_seq=n_seq, n_ctx_seq=n_ctx_seq, n_batch=n_batch,
                                n_threads=n_threads, flash_attn=flash_attn)
        self._held: list[list[int]] = [[] for _ in range(n_seq)]
        self.passes = 0  # the draft's llama_decode calls, for the figures

    def draft(self, seq: int, tokens: list[int], limit: int) -> list[int]:
        """Up to `limit` greedy guesses of the tokens after `tokens` (the slot's cells and
        its next token)."""
        limit = min(limit, self.ctx.n_ctx_seq - len(tokens))
        if limit <= 0 or not tokens:
            return []
        self._sync(seq, tokens)
        guesses: list[int] = []
        while True:
            token = int(self.ctx.row_logits(self.ctx.batch.n - 1).argmax())
            if self.model.is_eog(token):
                break
            guesses.append(token)
            if len(guesses) == limit:
                break  # its cell is written with the next guess, if it is confirmed
            self._feed(seq, [token])
        return guesses

    def _sync(self, seq: int, tokens: list[int]) -> None:
        """Makes `seq` hold `tokens`, keeping the cells that agree, and leaves the logits
        of the last one in the batch's last row."""
        held = self._held[seq]
        keep = common_prefix(held, tokens, len(tokens) - 1)  # the last one is always fed
        if keep < len(held) and not self.ctx.keep_prefix(seq, keep):
            self.ctx.clear(seq)
            keep = 0
        del held[keep:]
        rest = tokens[keep:]
        for start in range(0, len(rest), self.ctx.n_batch):
            self._feed(seq, rest[start : start + self.ctx.n_batch])

    def _feed(self, seq: int, chunk: list[int]) -> None:
        held = self._held[seq]
        batch = self.ctx.batch
        batch.clear()
        batch.add_span(chunk, len(held), seq, last_logits=True)
        try:
            self.ctx.decode()
        except Exception:
            self.forget(seq)
            raise
        self.passes += 1
        held.extend(chunk)

    def forget(self, seq: int) -> None:
        """Drops the sequence's cells (after a failed pass its cells are unknown)."""
        self.ctx.clear(seq)
        self._held[seq] = []

    def close(self) -> None:
        self.ctx.close()
        self.model.close()
