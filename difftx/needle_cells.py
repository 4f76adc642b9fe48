"""The multi-needle evaluation's default cells: the N/R pairs (needles in the prompt / keys
queried) of the paper's grid (section 3.4) and the depths of the answer needle. Without torch, so
the task settings (:mod:`difftx.tasks.needle`, read when the command line is built) and the
evaluation (:mod:`difftx.eval.needle`) both take them from here."""

DEFAULT_GRID: tuple[tuple[int, int], ...] = ((1, 1), (2, 2), (4, 2), (6, 2))
DEFAULT_DEPTHS: tuple[float, ...] = (0.0, 0.25, 0.5, 0.75, 1.0)
