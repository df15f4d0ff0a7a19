"""``nbddp.shared`` for a pandas DataFrame or Series: every column's values in one shared buffer (sharedbuffer.py),
the twin a ``DataFrame``/``Series`` subclass that pickles by handle.

Numbers, booleans, dates and durations stay numpy arrays (on the buffer); strings become Arrow strings
(pandas' own pyarrow string storage, on the buffer: one contiguous offsets array and one data array,
no Python object per row); a categorical keeps its codes on the buffer and its categories by value.
A column of anything else (dicts, lists, mixed objects, nullable extension types) is refused by name,
with the reason and what to do. Operations on a twin return plain pandas objects (views where pandas
makes views)."""
from __future__ import annotations

import functools

from ..errors import UsageError
from .sharedbuffer import Buffer, BufferWriter

_STRING_FIX = "pip install pyarrow (pandas' Arrow string storage keeps strings in one buffer)"


def share(obj, kind: str):
    out = BufferWriter("frame")
    if kind == "Series":
        layout = ("Series", obj.name, _index(obj.index, out), _column(obj.name, obj, out))
    else:
        if obj.columns.has_duplicates:
            raise UsageError("nbddp.shared: the DataFrame has duplicate column names "
                             f"{sorted(set(obj.columns[obj.columns.duplicated()]), key=str)}; rename them first.")
        cols = tuple((name, _column(name, obj[name], out)) for name in obj.columns)
        layout = ("DataFrame", _plain_index(obj.columns, "the column labels"), _index(obj.index, out), cols)
    return rebuild(out.seal(), layout)


def rebuild(buf: Buffer, layout):
    """The twin of ``layout`` over ``buf`` (in the kernel, or wherever it was unpickled)."""
    import pandas as pd

    if layout[0] == "Series":
        _, name, index, col = layout
        twin = _classes()[1](_values(buf, col), index=_index_from(buf, index), name=name, copy=False)
    else:
        _, columns, index, cols = layout
        data = {i: _values(buf, spec) for i, (_, spec) in enumerate(cols)}
        twin = _classes()[0](data, index=_index_from(buf, index), copy=False)
        twin.columns = pd.Index(columns, tupleize_cols=False) if not isinstance(columns, pd.Index) else columns
    object.__setattr__(twin, "_nbddp", (buf, layout))  # not in _metadata: derived objects are plain pandas
    return twin


# -- columns -----------------------------------------------------------------------------------------------------
def _column(name, col, out: BufferWriter):
    import numpy as np
    import pandas as pd

    dtype = col.dtype
    if isinstance(dtype, np.dtype) and dtype.kind in "biufcmM":
        values = np.ascontiguousarray(col.to_numpy())
        return ("numpy", dtype.str, len(values), out.append(values.view(np.uint8)))
    if isinstance(dtype, pd.CategoricalDtype):
        codes = np.ascontiguousarray(col.cat.codes.to_numpy())
        return ("category", codes.dtype.str, len(codes), out.append(codes.view(np.uint8)),
                dtype.categories, dtype.ordered)
    if isinstance(dtype, pd.StringDtype) or (dtype == object and _all_strings(col)):  # noqa: E721 - a numpy dtype
        return _strings(name, col, out)
    what = _what_objects(col) if dtype == object else f"dtype {dtype}"  # noqa: E721 - a numpy dtype
    raise UsageError(f"nbddp.shared cannot share column {name!r}: it holds {what}, and a shared DataFrame keeps "
                     "numbers, booleans, dates, strings and categoricals.\nShare that column as a sequence "
                     f"instead (nbddp.shared(df[{name!r}].tolist())), or convert it (.astype(...)), then share "
                     "the rest: nbddp.shared(df.drop(columns=[...])).")


def _strings(name, col, out: BufferWriter):
    try:
        import pyarrow as pa
    except ImportError:
        raise UsageError(f"nbddp.shared cannot share the string column {name!r} without pyarrow: {_STRING_FIX}."
                         ) from None
    import pandas as pd

    arr = pa.array(col.to_numpy(dtype=object, na_value=None), type=pa.large_string(), from_pandas=True)
    validity, offsets, data = arr.buffers()
    at = [out.append(b) if b is not None else None for b in (validity, offsets, data)]
    sizes = [b.size if b is not None else 0 for b in (validity, offsets, data)]
    na = col.dtype.na_value if isinstance(col.dtype, pd.StringDtype) else None
    return ("string", len(arr), arr.null_count, arr.offset, tuple(at), tuple(sizes), _na_key(na))


def _all_strings(col) -> bool:
    import pandas as pd

    return pd.api.types.infer_dtype(col, skipna=True) in ("string", "empty")


def _what_objects(col) -> str:
    types = {type(v).__name__ for v in col.head(1000) if v is not None}
    return "Python objects (" + ", ".join(sorted(types)[:4]) + ")"


def _values(buf: Buffer, spec):
    import numpy as np
    import pandas as pd

    kind = spec[0]
    if kind == "numpy":
        _, dt, n, at = spec
        return np.frombuffer(buf.map, dtype=np.dtype(dt), count=n, offset=at)
    if kind == "category":
        _, dt, n, at, categories, ordered = spec
        codes = np.frombuffer(buf.map, dtype=np.dtype(dt), count=n, offset=at)
        return pd.Categorical.from_codes(codes, dtype=pd.CategoricalDtype(categories, ordered))
    import pyarrow as pa

    _, n, nulls, offset, at, sizes, na = spec
    bufs = [pa.py_buffer(buf.view[a:a + size]) if a is not None else None for a, size in zip(at, sizes)]
    arr = pa.Array.from_buffers(pa.large_string(), n, bufs, null_count=nulls, offset=offset)
    dtype = pd.StringDtype("pyarrow", na_value=_na_value(na))
    return _arrow_strings(arr, dtype)


def _arrow_strings(arr, dtype):
    """A pandas string array wrapping ``arr`` without a copy."""
    import pandas as pd

    cls = pd.arrays.ArrowStringArray
    try:
        return cls(arr, dtype=dtype)
    except TypeError:  # pandas 2.x: no dtype argument (NaN semantics by the global option)
        return cls(arr)


def _na_key(na):
    return "nan" if isinstance(na, float) and na != na else None


def _na_value(key):
    import numpy as np
    import pandas as pd

    return np.nan if key == "nan" else pd.NA


# -- the index --------------------------------------------------------------------------------------------------
def _index(index, out: BufferWriter):
    import pandas as pd

    if isinstance(index, pd.RangeIndex):
        return ("range", index.start, index.stop, index.step, index.name)
    if isinstance(index, pd.MultiIndex):
        raise UsageError("nbddp.shared cannot share a MultiIndex: reset_index() first (its levels become columns).")
    return ("values", index.name, _column(f"index {index.name or ''}".strip(), index.to_series(), out))


def _index_from(buf: Buffer, spec):
    import pandas as pd

    if spec[0] == "range":
        _, start, stop, step, name = spec
        return pd.RangeIndex(start, stop, step, name=name)
    _, name, col = spec
    return pd.Index(_values(buf, col), name=name, copy=False)


def _plain_index(labels, what: str):
    import pandas as pd

    if isinstance(labels, pd.MultiIndex):
        raise UsageError(f"nbddp.shared cannot share a MultiIndex as {what}: flatten them first.")
    return list(labels)


# -- the twins' classes -------------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=1)
def _classes():
    """``SharedDataFrame``, ``SharedSeries``: made on first use (pandas is imported only then). Derived
    objects are plain pandas; pickling sends the buffer's handle and the layout, never the values."""
    import pandas as pd

    class Twin:
        def __reduce_ex__(self, protocol):
            return rebuild, self._nbddp

    class SharedDataFrame(Twin, pd.DataFrame):
        @property
        def _constructor(self):
            return pd.DataFrame

        @property
        def _constructor_sliced(self):
            return pd.Series

    class SharedSeries(Twin, pd.Series):
        @property
        def _constructor(self):
            return pd.Series

        @property
        def _constructor_expanddim(self):
            return pd.DataFrame

    for cls in (SharedDataFrame, SharedSeries):
        cls.__module__, cls.__qualname__ = __name__, cls.__name__
    return SharedDataFrame, SharedSeries
