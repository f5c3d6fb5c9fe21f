"""Regenerate the checked-in protobuf code from ``protos/``.

Run from a source checkout (needs the ``test`` extra for ``grpcio-tools``)::

    python -m memwal_query.protogen          # rewrite memwal_query/format/_proto/*_pb2.py(i)
    python -m memwal_query.protogen --check  # exit 1 when the checked-in code is stale

Staleness is judged on the compiled ``FileDescriptorProto`` embedded in the generated
module, so a different ``protoc`` version producing cosmetically different code does not
count as stale, while any change to a message, field or number does.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent
REPO_DIR = PACKAGE_DIR.parent
PROTO_DIR = REPO_DIR / "protos"
OUT_DIR = PACKAGE_DIR / "format" / "_proto"
PROTO_FILES = ["memwal.proto", "lance_table.proto"]


def _protoc(args: list[str], proto_dir: Path = PROTO_DIR) -> None:
    from grpc_tools import protoc

    well_known = Path(protoc.__file__).resolve().parent / "_proto"
    rc = protoc.main(["protoc", f"-I{proto_dir}", f"-I{well_known}", *args])
    if rc != 0:
        raise RuntimeError(f"protoc failed with exit code {rc}: {args}")


def generate(out_dir: Path = OUT_DIR) -> None:
    """Compile every file in ``PROTO_FILES`` into Python modules under ``out_dir``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    _protoc([f"--python_out={out_dir}", f"--pyi_out={out_dir}", *PROTO_FILES])


def compiled_descriptor(proto_file: str, proto_dir: Path = PROTO_DIR) -> bytes:
    """Return the serialized ``FileDescriptorProto`` that protoc builds from ``proto_dir``."""
    from google.protobuf import descriptor_pb2

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "set.pb"
        _protoc([f"--descriptor_set_out={out}", proto_file], proto_dir)
        fds = descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes())
    (fd,) = [f for f in fds.file if f.name == proto_file]
    return _normalized(fd)


def _normalized(fd) -> bytes:
    """Serialize a ``FileDescriptorProto`` without ``json_name`` (protoc omits it in code)."""

    def strip(messages) -> None:
        for message in messages:
            for field in message.field:
                field.ClearField("json_name")
            strip(message.nested_type)

    strip(fd.message_type)
    return fd.SerializeToString(deterministic=True)


def checked_in_descriptor(proto_file: str) -> bytes:
    """Return the serialized ``FileDescriptorProto`` embedded in the checked-in module."""
    import importlib

    from google.protobuf import descriptor_pb2

    module = importlib.import_module(
        f"memwal_query.format._proto.{proto_file.removesuffix('.proto')}_pb2"
    )
    fd = descriptor_pb2.FileDescriptorProto()
    module.DESCRIPTOR.CopyToProto(fd)
    return _normalized(fd)


def stale_files(proto_dir: Path = PROTO_DIR) -> list[str]:
    """Names of proto files whose checked-in generated code does not match ``proto_dir``."""
    return [f for f in PROTO_FILES if compiled_descriptor(f, proto_dir) != checked_in_descriptor(f)]


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only check for staleness")
    args = parser.parse_args(argv)
    if args.check:
        stale = stale_files()
        if stale:
            print(
                f"stale generated code for: {', '.join(stale)}; run python -m memwal_query.protogen"
            )
            return 1
        print("generated protobuf code is up to date")
        return 0
    generate()
    print(f"regenerated {', '.join(PROTO_FILES)} into {OUT_DIR}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
