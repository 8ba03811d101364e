"""normfast.data.checksum: a file comes back only as written -- its size and SHA-256 -- and a file that
is not a regular one (a link to /dev/zero) is refused without being read."""

from __future__ import annotations

import hashlib

from normfast.data.checksum import digest_path, read_checked, sha256_hex


def test_a_file_is_read_back_only_as_written(tmp_path):
    data = bytes(range(256)) * 5
    path = tmp_path / "heat-00000.safetensors"
    path.write_bytes(data)
    digest = hashlib.sha256(data).hexdigest()
    assert sha256_hex(data) == digest
    assert read_checked(path, digest, len(data)) == (data, None)
    assert read_checked(path, digest) == (data, None)
    flipped = bytearray(data)
    flipped[100] ^= 0x01
    path.write_bytes(bytes(flipped))
    assert read_checked(path, digest, len(data)) == (
        None,
        "its bytes do not match the SHA-256 recorded when it was written",
    )
    path.write_bytes(data[:-1])
    assert read_checked(path, digest, len(data)) == (None, "it holds 1,279 bytes, its manifest records 1,280")
    path.unlink()
    assert read_checked(path, digest, len(data)) == (None, "it does not exist")


def test_a_link_to_a_device_is_never_read(tmp_path):
    path = tmp_path / "heat-00001.safetensors"
    path.symlink_to("/dev/zero")
    data, why = read_checked(path, "0" * 64)  # no size given: a read would never end
    assert data is None and why == "it is not a regular file (a symbolic link to one that is not)"


def test_a_chunks_digest_file_is_named_after_it(tmp_path):
    assert digest_path(tmp_path / "chunk-0000003.parquet") == tmp_path / "chunk-0000003.parquet.sha256"
