"""The embedded default's one-time GGUF conversion parses the file once, and leaves gguf as it was."""

import gguf
import numpy as np
import pytest

from lora_ppo.builtin_model import _gguf_parsed_once


@pytest.fixture
def tiny_gguf(tmp_path):
    path = tmp_path / "tiny.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(2)
    writer.add_tensor("token_embd.weight", np.arange(12, dtype=np.float32).reshape(3, 4))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_gguf_file_is_parsed_once_during_conversion(tiny_gguf):
    original_reader, original_name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    with _gguf_parsed_once():
        # transformers does `from gguf import GGUFReader` inside each loader call.
        from gguf import GGUFReader, get_tensor_name_map

        first, second = GGUFReader(tiny_gguf), GGUFReader(str(tiny_gguf))
        assert first is second
        assert int(first.fields["llama.block_count"].parts[-1][0]) == 2
        assert np.array_equal(np.asarray(first.tensors[0].data), np.arange(12, dtype=np.float32).reshape(3, 4))
        arch = gguf.MODEL_ARCH.LLAMA
        assert get_tensor_name_map(arch, 2) is get_tensor_name_map(arch, 2)
    assert gguf.GGUFReader is original_reader and gguf.get_tensor_name_map is original_name_map
    assert gguf.GGUFReader(tiny_gguf) is not gguf.GGUFReader(tiny_gguf)


def test_gguf_is_restored_when_conversion_fails(tiny_gguf):
    original_reader = gguf.GGUFReader
    with pytest.raises(RuntimeError):
        with _gguf_parsed_once():
            raise RuntimeError("conversion failed")
    assert gguf.GGUFReader is original_reader
