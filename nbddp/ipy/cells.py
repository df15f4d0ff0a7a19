"""The notebook's cells as IPython numbers them, the same on every IPython nbddp supports (7.34 to 9).

Two facts differ between IPython versions, and nbddp reads both from here:

- which cell is running: ``execution_count`` is ``n`` while cell ``n`` runs on IPython < 9 and ``n + 1``
  on IPython 9 (which counts the cell before running it); IPython stores a cell's input before running
  it on all of them, so ``len(In) - 1`` is ``n`` everywhere (``running``);
- which file name is which cell (``Cell In[n]`` in tracebacks, the CUDA guard's site): IPython >= 8 keeps
  that map itself (``CachingCompiler._filename_map``); 7.x keeps none, so nbddp keeps its own there
  (``track``, at ``%load_ext``), filled as the compiler caches each cell (``numbers``).
"""
from __future__ import annotations

import linecache

OWN_MAP = "_nbddp_filename_map"  # on a 7.x compiler: nbddp's map, never IPython's name


def running(shell) -> int:
    """The number of the cell running now (its ``In[n]``); at ``post_run_cell``, the cell just run."""
    return max(1, len(shell.history_manager.input_hist_parsed) - 1)


def numbers(shell) -> dict:
    """File name -> cell number for every cell the shell's compiler cached: IPython's own map, or the
    one ``track`` keeps; a live dict that grows with each cell (empty outside IPython)."""
    compiler = getattr(shell, "compile", None)
    found = getattr(compiler, "_filename_map", None)
    if found is None:
        found = getattr(compiler, OWN_MAP, None)
    return found if found is not None else {}


def track(shell) -> None:
    """Where IPython keeps no file name -> cell map (7.x), keep one: every cell the compiler caches from
    now on is recorded, and the cells already run are found again from the history."""
    compiler = getattr(shell, "compile", None)
    if compiler is None or hasattr(compiler, "_filename_map") or hasattr(compiler, OWN_MAP):
        return  # IPython's own, or already tracked (%reload_ext)
    known = _cells_run(shell, compiler)
    cache = compiler.cache

    def cache_and_record(transformed_code, number=0, raw_code=None):
        name = cache(transformed_code, number, raw_code)
        known[name] = number
        return name

    compiler.cache = cache_and_record
    setattr(compiler, OWN_MAP, known)


def _cells_run(shell, compiler) -> dict:
    """The cells run before ``track``, named as the compiler named them when it cached them."""
    history = getattr(shell, "history_manager", None)
    parsed, raw = (getattr(history, "input_hist_parsed", []), getattr(history, "input_hist_raw", []))
    found = {}
    for number, (code, raw_code) in enumerate(zip(parsed, raw)):
        if not (number and code):
            continue
        # the history keeps a cell without its trailing newlines; ipykernel named it by its code as sent
        for sent in (raw_code, raw_code + "\n", raw_code + "\n\n"):
            try:
                name = compiler.get_code_name(sent, code, number)
            except Exception:  # noqa: BLE001 - a compiler that names cells otherwise: those stay unlabelled
                return found
            if name in linecache.cache:
                found[name] = number
                break
    return found
