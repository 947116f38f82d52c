"""A toy model whose answers a test writes: the trigger and the calls become deterministic."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from twostroke.engine.runners.toy import EOS_TOKEN_ID, ToyRunner, toy_text_choose

#: Where the toy's chat template leaves the model to answer.
_ANSWER = b"<assistant>"


def scripted_choose(reply: Callable[[str], str]) -> Callable[[Sequence[int], frozenset[int]], int]:
    """The toy's choice of token: the next byte of ``reply(prompt)``, then EOS.

    ``prompt`` is the rendered conversation (the toy template's text up to its last
    ``<assistant>``). Where a constraint refuses the scripted byte, the toy's own choice
    among the allowed ones is taken (so a test sees the constraint at work).
    """

    def choose(token_ids: Sequence[int], allowed: frozenset[int]) -> int:
        data = bytes(token for token in token_ids if token < EOS_TOKEN_ID)
        start = data.rfind(_ANSWER) + len(_ANSWER)
        wanted = reply(data[:start].decode("utf-8", errors="replace")).encode()
        written = len(data) - start
        target = wanted[written] if written < len(wanted) else EOS_TOKEN_ID
        if not allowed or target in allowed:
            return target
        return toy_text_choose(token_ids, allowed)

    return choose


class ScriptedRunner(ToyRunner):
    """The toy runner answering ``reply(prompt)``, constrained or not."""

    def __init__(self, reply: Callable[[str], str], **options: object) -> None:
        self._scripted = scripted_choose(reply)
        super().__init__(choose=self._scripted, **options)  # type: ignore[arg-type]

    def _next_token(self, token_ids: Sequence[int]) -> int:
        return self._scripted(token_ids, frozenset())
