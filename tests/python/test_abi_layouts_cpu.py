"""Every struct deep_ep_cpp lays out itself (ctypes Structures, and the ArgsLayouts that
struct.pack_into fills) against include/deepep_nccl.h compiled by gcc: field names in the header's
order, each field's offset and type, and the struct's size. No torch or GPU needed."""
import ctypes
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from deep_ep_cpp import _internode, _lib, _low_latency, _normal

HEADER = Path(__file__).resolve().parents[2] / "include" / "deepep_nccl.h"

CTYPES_STRUCTS = (_lib.DeepepTensor, _lib.DeepepConfig, _lib.DeepepOutputs)
ARGS_LAYOUTS = (_normal._DISPATCH, _normal._COMBINE, _internode._DISPATCH, _internode._COMBINE, _low_latency._DISPATCH,
                _low_latency._COMBINE)
# C type of a header field -> the ArgsLayout kind that packs it.
KINDS = {"DeepepTensor": "tensor", "DeepepConfig": "config", "int32_t": "int32"}
# C element type -> the ctypes type that must declare it.
CTYPES = {"int32_t": ctypes.c_int32, "int64_t": ctypes.c_int64, "void": ctypes.c_void_p}


def header_fields(name):
    """[(C type, field name, array length or None)] of `typedef struct { ... } name;` in the header."""
    text = HEADER.read_text()
    end = text.index(f"}} {name};")
    body = text[text.rindex("typedef struct {", 0, end):end]
    body = re.sub(r"/\*.*?\*/", "", body, flags=re.S)
    fields = re.findall(r"^\s+([A-Za-z_0-9]+)\s*(\*?)\s*([a-z_0-9]+)(?:\[([A-Z_0-9]+)\])?;", body, flags=re.M)
    assert fields, f"no fields parsed for {name}"
    return [(ctype + star, field, size or None) for ctype, star, field, size in fields]


def compiled_layout(tmp_path, structs):
    """{"S": sizeof, "S.f": offsetof} for each struct name -> field names, from gcc."""
    if shutil.which("gcc") is None:
        pytest.skip("no gcc")
    lines = []
    for name, fields in structs.items():
        lines.append(f'  printf("{name} %zu\\n", sizeof({name}));')
        lines += [f'  printf("{name}.{f} %zu\\n", offsetof({name}, {f}));' for f in fields]
    src = tmp_path / "layout.c"
    src.write_text('#include <stddef.h>\n#include <stdio.h>\n#include "deepep_nccl.h"\nint main(void) {\n'
                   + "\n".join(lines) + "\n  return 0;\n}\n")
    exe = tmp_path / "layout"
    subprocess.run(["gcc", "-std=c11", "-Wall", "-Werror", f"-I{HEADER.parent}", str(src), "-o", str(exe)],
                   check=True, capture_output=True, text=True)
    out = subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout
    return {k: int(v) for k, v in (line.split() for line in out.splitlines())}


def test_ctypes_structs_match_the_header(tmp_path):
    structs = {cls.__name__: [f for f, _ in cls._fields_] for cls in CTYPES_STRUCTS}
    got = compiled_layout(tmp_path, structs)
    for cls in CTYPES_STRUCTS:
        name = cls.__name__
        fields = header_fields(name)
        assert [f for _, f, _ in fields] == structs[name], f"{name}: field names or order differ from the header"
        assert got[name] == ctypes.sizeof(cls), name
        for (ctype, field, length), (_, declared) in zip(fields, cls._fields_):
            assert got[f"{name}.{field}"] == getattr(cls, field).offset, f"{name}.{field}"
            element = getattr(declared, "_type_", declared) if length else declared
            if length:
                assert declared._length_ == _lib.abi_constant(length), f"{name}.{field}: array length"
            if ctype.rstrip("*") in CTYPES:
                want = CTYPES["void"] if ctype.endswith("*") else CTYPES[ctype]
                assert element is want, f"{name}.{field}: {ctype} declared as {element}"
            else:
                assert element.__name__ == ctype, f"{name}.{field}: {ctype} declared as {element}"


@pytest.mark.parametrize("layout", ARGS_LAYOUTS, ids=lambda a: f"{a.c_name}")
def test_packed_args_match_the_header(tmp_path, layout):
    fields = header_fields(layout.c_name)
    assert [(f, KINDS[c]) for c, f, n in fields if n is None] == list(layout.fields), \
        f"{layout.c_name}: names, order or types differ from the header"
    got = compiled_layout(tmp_path, {layout.c_name: [f for f, _ in layout.fields]})
    assert got[layout.c_name] == layout.struct.size
    for field, _ in layout.fields:
        assert got[f"{layout.c_name}.{field}"] == layout.offset(field), f"{layout.c_name}.{field}"


def test_a_swapped_field_is_caught():
    """The check above is by name: two int32 fields swapped in Python's declaration fail it."""
    fields = list(_normal._DISPATCH.fields)
    i, j = fields.index(("cached", "int32")), fields.index(("expert_alignment", "int32"))
    fields[i], fields[j] = fields[j], fields[i]
    header = [(f, KINDS[c]) for c, f, n in header_fields("DeepepIntranodeDispatchArgs")]
    assert header != fields


def test_constants_come_from_the_library():
    """Each public #define of the header, read through deepep_abi_constant, as Python sees it."""
    defines = dict(re.findall(r"^#define (DEEPEP_[A-Z_0-9]+) (\d+)$", HEADER.read_text(), flags=re.M))
    assert {"DEEPEP_MAX_DIMS", "DEEPEP_MAX_OP_OUTPUTS", "DEEPEP_MAX_LOCAL_EXPERTS"} <= set(defines)
    for name, value in defines.items():
        assert _lib.abi_constant(name) == int(value), name
    assert _lib.ABI_VERSION == int(defines["DEEPEP_ABI_VERSION"]) == _lib.lib.deepep_abi_version()
    with pytest.raises(ImportError, match="DEEPEP_NO_SUCH"):
        _lib.abi_constant("DEEPEP_NO_SUCH")
