"""What the generator's watchers share: hooks (or patches) that hold while ``with`` lasts."""


class Watch:
    """Subclasses add an undo callable (a hook's ``remove``) to ``_undo`` for each hook they set."""

    def __init__(self):
        self._undo = []

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        for undo in self._undo:
            undo()
        self._undo = []


def topk_boundary_gap(vis, k: int, chosen, row: int) -> float:
    """The k-th minus the (k+1)-th of one query row's visible index scores (a torch vector longer
    than k); where that gap is not a (near) tie, ``chosen`` (transformers' top-k) must be the k best."""
    import torch
    v, order = torch.sort(vis, descending=True, stable=True)
    gap = float(v[k - 1] - v[k])
    if gap > 1e-6 and set(order[:k].tolist()) != set(chosen.tolist()):
        raise AssertionError(f"indexer recomputation disagrees with transformers at row {row}")
    return gap
