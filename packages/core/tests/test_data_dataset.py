"""polydist.data.Dataset: tf.data's operations, values, cardinality and element_spec."""

from __future__ import annotations

import collections
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from polydist.data import (
    AUTOTUNE,
    INFINITE_CARDINALITY,
    SHARD_HINT,
    UNKNOWN_CARDINALITY,
    AutoShardPolicy,
    Dataset,
    Options,
    TensorSpec,
    TextLineDataset,
)

Point = collections.namedtuple("Point", ["x", "y"])


def values(dataset: Dataset) -> list[Any]:
    return [np.asarray(element).tolist() for element in dataset]


# ------------------------------------------------------------------ sources


def test_range_forms_and_dtype() -> None:
    assert values(Dataset.range(5)) == [0, 1, 2, 3, 4]
    assert values(Dataset.range(2, 5)) == [2, 3, 4]
    assert values(Dataset.range(10, 0, -3)) == [10, 7, 4, 1]
    element = next(iter(Dataset.range(3)))
    assert element.dtype == np.int64
    assert element.shape == ()
    assert Dataset.range(3).element_spec == TensorSpec((), np.int64)
    assert Dataset.range(10, 0, -3).cardinality() == 4
    with pytest.raises(ValueError, match="non-zero"):
        Dataset.range(0, 5, 0)


@pytest.mark.parametrize(
    ("value", "dtype"),
    [
        ([1, 2], np.int32),
        ([2**40, 1], np.int64),
        ([1.5, 2], np.float32),
        ([True, False], np.bool_),
        (np.array([1, 2], dtype=np.int64), np.int64),
        (np.array([1.0, 2.0]), np.float64),
    ],
)
def test_python_values_convert_like_tf(value: Any, dtype: Any) -> None:
    first = next(iter(Dataset.from_tensor_slices(value)))
    assert first.dtype == dtype
    assert first.shape == ()


def test_scalars_in_from_tensors_convert_like_tf() -> None:
    element = next(iter(Dataset.from_tensors((1, 2.5, True, "text"))))
    assert [x.dtype for x in element[:3]] == [np.int32, np.float32, np.bool_]
    assert element[3].dtype.kind == "U"
    assert element[3][()] == "text"
    assert Dataset.from_tensors(1).element_spec == TensorSpec((), np.int32)


def test_from_tensor_slices_strings() -> None:
    dataset = Dataset.from_tensor_slices(["a", "bc"])
    assert values(dataset) == ["a", "bc"]
    assert dataset.element_spec == TensorSpec((), np.str_)


def test_from_tensor_slices_nests() -> None:
    dataset = Dataset.from_tensor_slices({"x": np.arange(3), "y": (np.arange(3) * 2, [7, 8, 9])})
    elements = list(dataset)
    assert elements[1]["x"] == 1
    assert elements[1]["y"][0] == 2
    assert elements[1]["y"][1] == 8
    assert dataset.element_spec == {
        "x": TensorSpec((), np.int64),
        "y": (TensorSpec((), np.int64), TensorSpec((), np.int32)),
    }
    point = next(iter(Dataset.from_tensor_slices(Point(np.arange(2), np.arange(2)))))
    assert isinstance(point, Point)


def test_from_tensor_slices_snapshots_its_input() -> None:
    array = np.arange(3)
    dataset = Dataset.from_tensor_slices(array)
    array[0] = 99
    assert values(dataset) == [0, 1, 2]


def test_from_tensor_slices_errors() -> None:
    with pytest.raises(ValueError, match="Dimensions 2 and 3 are not compatible"):
        Dataset.from_tensor_slices((np.arange(3), np.arange(2)))
    with pytest.raises(ValueError, match="rank >= 1"):
        Dataset.from_tensor_slices(5)
    with pytest.raises(TypeError, match="None"):
        Dataset.from_tensor_slices((np.arange(2), None))


def test_from_generator_with_signature_casts_and_checks() -> None:
    signature = (TensorSpec((None,), np.int64), TensorSpec((), np.float32))
    dataset = Dataset.from_generator(lambda: iter([([1, 2], 0.5), ([3], 1)]), signature)
    elements = list(dataset)
    assert elements[0][0].dtype == np.int64
    assert elements[1][1].dtype == np.float32
    assert dataset.element_spec == signature
    assert dataset.cardinality() == UNKNOWN_CARDINALITY
    assert [np.asarray(e[0]).tolist() for e in dataset] == [[1, 2], [3]]  # re-iterable

    wrong_shape = Dataset.from_generator(lambda: iter([[1, 2]]), TensorSpec((3,), np.int64))
    with pytest.raises(ValueError, match=r"shape \(2,\) where an element of shape \(3,\)"):
        list(wrong_shape)
    wrong_type = Dataset.from_generator(lambda: iter([1.5]), TensorSpec((), np.int64))
    with pytest.raises(TypeError, match="could not be converted"):
        list(wrong_type)
    not_text = Dataset.from_generator(lambda: iter([1]), TensorSpec((), np.str_))
    with pytest.raises(TypeError, match="could not be converted"):
        list(not_text)
    wrong_structure = Dataset.from_generator(lambda: iter([1]), signature)
    with pytest.raises(TypeError, match="did not match the expected structure"):
        list(wrong_structure)


def test_from_generator_without_signature_infers_dtypes_and_ranks() -> None:
    dataset = Dataset.from_generator(lambda: iter([{"a": [1, 2]}, {"a": [3]}]))
    assert dataset.element_spec == {"a": TensorSpec((None,), np.int32)}
    with pytest.raises(ValueError, match="produced no element"):
        _ = Dataset.from_generator(lambda: iter([])).element_spec
    with pytest.raises(TypeError, match="callable"):
        Dataset.from_generator([1, 2])  # type: ignore[arg-type]


def refilling(buffer: np.ndarray) -> Any:
    """A generator function that refills one buffer before each yield (a loader pattern)."""

    def generate() -> Any:
        for k in range(3):
            buffer[:] = np.arange(buffer.size) + 10 * k
            yield buffer

    return generate


def test_from_generator_elements_do_not_alias_a_refilled_buffer() -> None:
    # TF's from_generator converts each yield to a new tensor.
    buffer = np.zeros(2, np.float32)
    signature = TensorSpec((2,), np.float32)
    expected = [[0.0, 1.0], [10.0, 11.0], [20.0, 21.0]]
    assert values(Dataset.from_generator(refilling(buffer), output_signature=signature)) == expected
    assert values(Dataset.from_generator(refilling(buffer))) == expected
    batched = Dataset.from_generator(refilling(buffer), output_signature=signature).batch(3)
    assert values(batched) == [expected]
    cast = Dataset.from_generator(refilling(buffer), output_signature=TensorSpec((2,), np.float64))
    assert values(cast) == expected


def test_text_line_dataset(tmp_path: Path) -> None:
    first = tmp_path / "a.txt"
    first.write_bytes(b"one\r\ntwo\n")
    second = tmp_path / "b.txt"
    second.write_bytes(b"three")
    dataset = TextLineDataset([first, second])
    assert values(dataset) == ["one", "two", "three"]
    assert dataset.element_spec == TensorSpec((), np.str_)
    assert dataset.cardinality() == UNKNOWN_CARDINALITY
    assert dataset._file_sources() == (str(first), str(second))
    assert TextLineDataset(first).map(lambda line: line)._file_sources() == (str(first),)


def test_from_files_and_file_sources(tmp_path: Path) -> None:
    path = tmp_path / "rows.txt"
    path.write_text("1 2\n3 4\n")

    def read_rows(name: str) -> Any:
        with open(name) as handle:
            for line in handle:
                yield np.array(line.split(), dtype=np.int64)

    dataset = Dataset.from_files(path, read_rows)
    assert values(dataset) == [[1, 2], [3, 4]]
    assert dataset.element_spec == TensorSpec((None,), np.int64)
    assert dataset.batch(2).prefetch(1)._file_sources() == (str(path),)
    assert Dataset.range(3).batch(2)._file_sources() is None
    assert Dataset.from_files(path, read_rows).unbatch()._file_sources() == (str(path),)


# ---------------------------------------------------------- transformations


def test_batch_values_spec_and_cardinality() -> None:
    batched = Dataset.range(10).batch(4)
    assert values(batched) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert batched.element_spec == TensorSpec((None,), np.int64)
    assert batched.cardinality() == 3
    dropped = Dataset.range(10).batch(4, drop_remainder=True)
    assert values(dropped) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert dropped.element_spec == TensorSpec((4,), np.int64)
    assert dropped.cardinality() == 2
    assert Dataset.range(8).batch(4).element_spec == TensorSpec((None,), np.int64)
    assert Dataset.range(3).repeat().batch(2).cardinality() == INFINITE_CARDINALITY


def test_batch_nested_and_errors() -> None:
    dataset = Dataset.from_tensor_slices({"a": np.arange(4), "b": np.ones((4, 2))}).batch(3)
    first = next(iter(dataset))
    assert first["b"].shape == (3, 2)
    assert dataset.element_spec["b"] == TensorSpec((None, 2), np.float64)
    ragged = Dataset.from_generator(lambda: iter([[1], [1, 2]])).batch(2)
    with pytest.raises(ValueError, match="different shapes in component 0"):
        list(ragged)
    with pytest.raises(ValueError, match="greater than zero"):
        Dataset.range(3).batch(0)


def test_unbatch() -> None:
    dataset = Dataset.range(10).batch(4).unbatch()
    assert values(dataset) == list(range(10))
    assert dataset.element_spec == TensorSpec((), np.int64)
    assert dataset.cardinality() == UNKNOWN_CARDINALITY  # batch size not static
    static = Dataset.range(8).batch(4, drop_remainder=True).unbatch()
    assert static.cardinality() == 8
    rows = Dataset.from_tensors(np.arange(6).reshape(3, 2)).unbatch()
    assert values(rows) == [[0, 1], [2, 3], [4, 5]]
    with pytest.raises(ValueError, match="scalar components"):
        _ = Dataset.range(3).unbatch().element_spec
    with pytest.raises(ValueError, match="non-scalar value"):
        list(Dataset.range(3).unbatch())


def test_shard() -> None:
    assert values(Dataset.range(10).shard(3, 1)) == [1, 4, 7]
    assert Dataset.range(10).shard(3, 0).cardinality() == 4
    assert Dataset.range(10).shard(3, 2).cardinality() == 3
    with pytest.raises(ValueError, match="Number of shards must be greater than zero"):
        Dataset.range(3).shard(0, 0)
    with pytest.raises(ValueError, match="Index must be between 0 and 1"):
        Dataset.range(3).shard(2, 2)
    hinted = Dataset.range(4).shard(SHARD_HINT, SHARD_HINT)
    with pytest.raises(ValueError, match="SHARD_HINT"):
        iter(hinted)


def test_repeat() -> None:
    assert values(Dataset.range(3).repeat(2)) == [0, 1, 2, 0, 1, 2]
    assert values(Dataset.range(3).repeat().take(7)) == [0, 1, 2, 0, 1, 2, 0]
    assert Dataset.range(3).repeat(2).cardinality() == 6
    assert Dataset.range(3).repeat().cardinality() == INFINITE_CARDINALITY
    assert Dataset.range(3).repeat(0).cardinality() == 0
    assert Dataset.range(0).repeat().cardinality() == 0
    assert values(Dataset.range(0).repeat()) == []  # terminates
    assert Dataset.range(3).filter(lambda x: True).repeat(2).cardinality() == UNKNOWN_CARDINALITY


def test_map_unpacks_tuples_only() -> None:
    pairs = Dataset.from_tensor_slices((np.arange(3), np.arange(3) * 10))
    assert values(pairs.map(lambda x, y: x + y)) == [0, 11, 22]
    dicts = Dataset.from_tensor_slices({"a": np.arange(2)})
    assert values(dicts.map(lambda d: d["a"] * 2)) == [0, 2]
    points = Dataset.from_tensor_slices(Point(np.arange(2), np.arange(2)))
    assert values(points.map(lambda p: p.x + p.y)) == [0, 2]


def test_map_outputs_convert_like_tf() -> None:
    mapped = Dataset.range(2).map(lambda x: [x, 1])  # a list becomes a tuple
    first = next(iter(mapped))
    assert isinstance(first, tuple)
    assert first[1].dtype == np.int32
    assert mapped.element_spec == (TensorSpec((), np.int64), TensorSpec((), np.int32))
    assert mapped.cardinality() == 2


def test_map_element_spec_follows_the_function() -> None:
    doubled = Dataset.range(10).batch(4).map(lambda x: x * 2.0)
    assert doubled.element_spec == TensorSpec((None,), np.float64)
    reshaped = Dataset.range(8).batch(4, drop_remainder=True).map(lambda x: x.reshape(2, 2))
    assert reshaped.element_spec == TensorSpec((2, 2), np.int64)
    positive = Dataset.range(4).batch(4).map(lambda x: x[x > 0])  # value-dependent size
    assert positive.element_spec == TensorSpec((None,), np.int64)


def test_map_element_spec_falls_back_to_real_data() -> None:
    def strict(x: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
        if int(x) == 0 or int(x) == 1:  # synthetic probes are all zeros or ones
            raise ValueError("probe")
        return np.arange(int(x))

    assert Dataset.range(3, 5).map(strict).element_spec == TensorSpec((None,), np.int64)


def test_filter() -> None:
    evens = Dataset.range(10).filter(lambda x: x % 2 == 0)
    assert values(evens) == [0, 2, 4, 6, 8]
    assert evens.cardinality() == UNKNOWN_CARDINALITY
    pairs = Dataset.from_tensor_slices((np.arange(4), np.arange(4)))
    assert len(list(pairs.filter(lambda x, y: bool(x < 2)))) == 2
    with pytest.raises(ValueError, match="scalar boolean"):
        list(Dataset.range(3).filter(lambda x: x))


def test_take_and_skip() -> None:
    assert values(Dataset.range(10).take(3)) == [0, 1, 2]
    assert values(Dataset.range(10).take(-1)) == list(range(10))
    assert values(Dataset.range(10).skip(7)) == [7, 8, 9]
    assert values(Dataset.range(10).skip(-1)) == []
    assert Dataset.range(10).take(3).cardinality() == 3
    assert Dataset.range(2).take(3).cardinality() == 2
    assert Dataset.range(2).repeat().take(3).cardinality() == 3
    assert Dataset.range(10).skip(7).cardinality() == 3
    assert Dataset.range(10).skip(20).cardinality() == 0
    assert Dataset.range(2).repeat().skip(3).cardinality() == INFINITE_CARDINALITY


def test_shuffle_is_a_seeded_permutation() -> None:
    first = values(Dataset.range(20).shuffle(5, seed=7))
    again = values(Dataset.range(20).shuffle(5, seed=7))
    assert first == again
    assert sorted(first) == list(range(20))
    assert first != list(range(20))
    assert values(Dataset.range(20).shuffle(1, seed=7)) == list(range(20))
    assert Dataset.range(20).shuffle(5).cardinality() == 20


def test_shuffle_reshuffles_each_iteration() -> None:
    reshuffled = Dataset.range(20).shuffle(20, seed=3)
    assert values(reshuffled) != values(reshuffled)
    fixed = Dataset.range(20).shuffle(20, seed=3, reshuffle_each_iteration=False)
    assert values(fixed) == values(fixed)
    with pytest.raises(ValueError, match="buffer_size"):
        Dataset.range(3).shuffle(0)


def test_prefetch_reads_ahead_without_changing_elements() -> None:
    produced: list[int] = []

    def record(x: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
        produced.append(int(x))
        return x

    iterator = iter(Dataset.range(10).map(record).prefetch(3))
    assert int(next(iterator)) == 0
    assert produced == [0, 1, 2, 3]
    assert values(Dataset.range(5).prefetch(AUTOTUNE)) == [0, 1, 2, 3, 4]
    assert values(Dataset.range(5).prefetch(0)) == [0, 1, 2, 3, 4]
    with pytest.raises(ValueError, match="AUTOTUNE"):
        Dataset.range(3).prefetch(-2)


# ----------------------------------------------------------------- metadata


def test_iteration_helpers() -> None:
    dataset = Dataset.range(3)
    assert values(dataset) == values(dataset)  # re-iterable
    scalar = next(Dataset.range(3).as_numpy_iterator())
    assert isinstance(scalar, np.int64)
    assert len(Dataset.range(4).batch(3)) == 2
    assert bool(Dataset.range(0).filter(lambda x: True))
    with pytest.raises(TypeError, match="infinite"):
        len(Dataset.range(1).repeat())
    with pytest.raises(TypeError, match="unknown"):
        len(Dataset.range(1).filter(lambda x: True))
    assert repr(Dataset.range(3).batch(2)) == "<Dataset BatchDataset <- RangeDataset>"


def test_options_merge_and_propagate() -> None:
    assert Dataset.range(3).options().experimental_distribute.auto_shard_policy == (
        AutoShardPolicy.AUTO
    )
    off = Options()
    off.experimental_distribute.auto_shard_policy = AutoShardPolicy.OFF
    dataset = Dataset.range(6).with_options(off).batch(2)
    assert dataset.options().experimental_distribute.auto_shard_policy == AutoShardPolicy.OFF
    data = Options()
    data.experimental_distribute.auto_shard_policy = AutoShardPolicy.DATA
    assert dataset.with_options(data).options() == data
    assert dataset.with_options(Options()).options() == off  # unset values do not override
    off.experimental_distribute.auto_shard_policy = AutoShardPolicy.FILE  # later mutation
    assert dataset.options().experimental_distribute.auto_shard_policy == AutoShardPolicy.OFF
    assert values(dataset) == [[0, 1], [2, 3], [4, 5]]
    with pytest.raises(TypeError, match="AutoShardPolicy"):
        off.experimental_distribute.auto_shard_policy = 1  # type: ignore[assignment]
    with pytest.raises(TypeError, match="Options"):
        Dataset.range(3).with_options({"auto_shard_policy": 1})  # type: ignore[arg-type]


def test_auto_shard_policy_values_match_tf() -> None:
    assert [int(p) for p in AutoShardPolicy] == [-1, 0, 1, 2, 3]
    assert [p.name for p in AutoShardPolicy] == ["OFF", "AUTO", "FILE", "DATA", "HINT"]


def test_tensor_spec() -> None:
    spec = TensorSpec([None, 3], "float32")
    assert spec.shape == (None, 3)
    assert spec.dtype == np.float32
    assert spec.is_compatible_with(np.zeros((5, 3), np.float32))
    assert not spec.is_compatible_with(np.zeros((5, 4), np.float32))
    assert not spec.is_compatible_with(np.zeros((5, 3), np.float64))
    assert TensorSpec((), "<U7") == TensorSpec((), np.str_)
    assert TensorSpec((2,)).dtype == np.float32
    with pytest.raises(ValueError, match=">= 0"):
        TensorSpec((-1,))
