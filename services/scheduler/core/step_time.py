"""How long a worker step takes, fitted from the steps just run, so prefill chunks beside
running decodes can be sized to keep the streams' inter-token latency (ITL) in bounds.

A step's time is fitted as `a + b * decode_tokens + c * prefill_tokens` by least squares over
the recent steps (each step's weight decays by half every `half_life` steps, so the fit
follows a machine that speeds up or slows down). Until the steps say otherwise a decode
token is taken to cost what a prompt token does: after a run of single streams (decode
steps of one row, prompts prefilled alone) the fixed and per-decode costs cannot be told
apart, and that guess of what 8 rows take is closer than none.

A step carrying decodes and a prefill chunk delays every decoding stream's next token by the
chunk's share of the step; with `max_itl_factor` F the chunk is held to what keeps the step
within F times the decode-only step (Sarathi-Serve's idea: a time budget per step instead of
a token budget alone).
"""

from __future__ import annotations

_RIDGE = 1e-6   # keeps the fit defined while a column never varies (every step 8 decodes)


class StepTimeModel:
    def __init__(self, half_life: float = 128.0, min_steps: int = 16) -> None:
        self._decay = 0.5 ** (1.0 / half_life)
        self._min_steps = min_steps
        self._num_steps = 0
        # Decayed sums of x x^T and x t over the steps, x = (1, decode tokens, all tokens):
        # the fit's second term is what a decode token costs beyond a prompt token, and the
        # ridge shrinks it toward 0 where the steps leave it open.
        self._xx = [[0.0] * 3 for _ in range(3)]
        self._xt = [0.0] * 3
        self._coefficients: tuple[float, float, float] | None = None

    def observe(self, num_decode_tokens: int, num_prefill_tokens: int, seconds: float) -> None:
        """One step the worker ran: its decode tokens, prefill tokens, and execution time."""
        if seconds <= 0 or num_decode_tokens + num_prefill_tokens == 0:
            return
        x = (1.0, float(num_decode_tokens), float(num_decode_tokens + num_prefill_tokens))
        decay = self._decay
        for i in range(3):
            row = self._xx[i]
            for j in range(3):
                row[j] = row[j] * decay + x[i] * x[j]
            self._xt[i] = self._xt[i] * decay + x[i] * seconds
        self._num_steps += 1
        self._coefficients = None

    def coefficients(self) -> tuple[float, float, float] | None:
        """(a, b, c) in seconds: fixed, per decode token, per prefill token; None until
        enough steps ran."""
        if self._num_steps < self._min_steps:
            return None
        if self._coefficients is None:
            xx = [row[:] for row in self._xx]
            for i in range(1, 3):
                xx[i][i] += _RIDGE * xx[0][0]
            solved = _solve3(xx, self._xt)
            if solved is not None:
                fixed, decode_surcharge, per_token = solved
                self._coefficients = (fixed, decode_surcharge + per_token, per_token)
        return self._coefficients

    def prefill_token_cap(self, num_decode_tokens: int, max_itl_factor: float) -> int | None:
        """Most prefill tokens a step carrying `num_decode_tokens` decodes may add while it
        stays within `max_itl_factor` times the decode-only step; None: no cap (no decodes,
        the guard off, or no fit yet: prefill has not been seen beside decodes)."""
        if num_decode_tokens == 0 or max_itl_factor <= 0:
            return None
        fit = self.coefficients()
        if fit is None:
            return None
        a, b, c = fit
        decode_only_s = a + b * num_decode_tokens
        if c <= 0 or decode_only_s <= 0:
            return None
        return int((max_itl_factor - 1.0) * decode_only_s / c + 1e-6)   # 11.99999 is 12


def _solve3(m: list[list[float]], v: list[float]) -> tuple[float, float, float] | None:
    """m x = v by Gaussian elimination with partial pivoting; None when m is singular."""
    a = [m[i][:] + [v[i]] for i in range(3)]
    for col in range(3):
        pivot = max(range(col, 3), key=lambda r: abs(a[r][col]))
        if abs(a[pivot][col]) < 1e-300:
            return None
        a[col], a[pivot] = a[pivot], a[col]
        for r in range(col + 1, 3):
            f = a[r][col] / a[col][col]
            for k in range(col, 4):
                a[r][k] -= f * a[col][k]
    x = [0.0, 0.0, 0.0]
    for i in (2, 1, 0):
        x[i] = (a[i][3] - sum(a[i][k] * x[k] for k in range(i + 1, 3))) / a[i][i]
    return x[0], x[1], x[2]
