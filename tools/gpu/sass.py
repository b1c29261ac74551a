"""Counts the flash-attention kernels' sm_90 machine code per head size (run by sass.sh, which
sets NVRTC_LIB, PTXAS, CUOBJDUMP and NVDISASM_PATH)."""
import argparse
import collections
import ctypes
import os
import re
import subprocess
import sys
import tempfile

CU = "megatron-core/src/cuda/cu"


def source(rev, name):
    if rev is None:
        return open(os.path.join(CU, name)).read()
    return subprocess.run(["git", "show", f"{rev}:{CU}/{name}"], check=True,
                          capture_output=True, text=True).stdout


def one_head_size(text, d):
    """The program with every kernel's head-size switch reduced to the instantiation for d."""
    out, n = re.subn(r"switch \(d\) \{.*?default: break;\s*\\\n\s*\}", f"CALL({d});", text,
                     flags=re.S)
    if n != 1:
        sys.exit("flash_attention.cu: expected one FA_DISPATCH switch to specialise")
    return out


def ptx(text):
    """PTX from NVRTC, with the options the CUDA backend compiles with (programs.rs)."""
    lib = ctypes.CDLL(os.environ["NVRTC_LIB"])
    prog = ctypes.c_void_p()
    if lib.nvrtcCreateProgram(ctypes.byref(prog), text.encode(), b"flash_attention.cu", 0, None,
                              None):
        sys.exit("nvrtcCreateProgram failed")
    opts = [b"--std=c++17", b"--gpu-architecture=sm_90"]
    status = lib.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts))
    n = ctypes.c_size_t()
    if status:
        lib.nvrtcGetProgramLogSize(prog, ctypes.byref(n))
        log = ctypes.create_string_buffer(n.value)
        lib.nvrtcGetProgramLog(prog, log)
        sys.exit(log.value.decode())
    lib.nvrtcGetPTXSize(prog, ctypes.byref(n))
    buf = ctypes.create_string_buffer(n.value)
    lib.nvrtcGetPTX(prog, buf)
    return buf.value


def assemble(ptx_bytes, tmp):
    """(cubin path, {kernel: (registers, spill bytes)}) from ptxas -v."""
    src, cubin = os.path.join(tmp, "fa.ptx"), os.path.join(tmp, "fa.cubin")
    open(src, "wb").write(ptx_bytes)
    log = subprocess.run([os.environ["PTXAS"], "-arch=sm_90", "-v", src, "-o", cubin],
                         check=True, capture_output=True, text=True).stderr
    info, kernel = {}, None
    for line in log.splitlines():
        m = re.search(r"Compiling entry function '(\w+)'", line)
        if m:
            kernel = m.group(1)
        m = re.search(r"(\d+) bytes spill stores", line)
        if m and kernel:
            info.setdefault(kernel, [0, 0])[1] = max(info.get(kernel, [0, 0])[1], int(m.group(1)))
        m = re.search(r"Used (\d+) registers", line)
        if m and kernel:
            info.setdefault(kernel, [0, 0])[0] = int(m.group(1))
    return cubin, info


def functions(cubin):
    """{kernel: [(address, instruction)]} from cuobjdump -sass."""
    text = subprocess.run([os.environ["CUOBJDUMP"], "-sass", cubin], check=True,
                          capture_output=True, text=True).stdout
    funcs, name = {}, None
    for line in text.splitlines():
        m = re.search(r"Function : (\S+)", line)
        if m:
            name = m.group(1)
            funcs[name] = []
            continue
        m = re.match(r"\s+/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;", line)
        if m and name:
            funcs[name].append((int(m.group(1), 16), m.group(2)))
    return funcs


def main_loop(ins):
    """The instructions under the longest backward branch: the loop over tiles (its rarely
    taken paths, unaligned rows and the like, included)."""
    best = (0, 0, -1)
    for addr, text in ins:
        m = re.search(r"BRA (0x[0-9a-f]+)", text)
        if m and int(m.group(1), 16) < addr and addr - int(m.group(1), 16) > best[0]:
            best = (addr - int(m.group(1), 16), int(m.group(1), 16), addr)
    return [t for a, t in ins if best[1] <= a <= best[2]]


def opcode(text):
    return re.sub(r"^@!?U?P\w+\s+", "", text).split()[0]


CLASSES = {
    "HMMA": r"^HMMA",
    "LDSM": r"^LDSM",
    "MUFU": r"^MUFU",
    "int": r"^(IMAD|IADD|LOP|ISETP|SHF|LEA|SEL|PLOP|VIADD|PRMT)",
    "float": r"^(FMUL|FADD|FFMA|FMNMX|FSETP|FSEL|F2FP)",
}


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rev", help="a commit's kernels instead of the working tree's")
    ap.add_argument("--dims", default="32,64,96,128", help="head sizes")
    ap.add_argument("--ops", help="also list the main loop's opcodes of this kernel")
    args = ap.parse_args()
    text = source(args.rev, "common.cuh") + "\n" + source(args.rev, "flash_attention.cu")
    print(f"{'kernel':22} {'d':>4} {'regs':>5} {'spill':>5} {'instr':>6} | main loop: "
          f"{'instr':>5} " + " ".join(f"{c:>5}" for c in CLASSES))
    with tempfile.TemporaryDirectory() as tmp:
        for d in [int(x) for x in args.dims.split(",")]:
            cubin, info = assemble(ptx(one_head_size(text, d)), tmp)
            for name, ins in sorted(functions(cubin).items()):
                if name == "flash_backward_prepare":
                    continue
                loop = [opcode(t) for t in main_loop(ins)]
                counts = [sum(1 for o in loop if re.match(p, o)) for p in CLASSES.values()]
                regs, spill = info.get(name, [0, 0])
                print(f"{name:22} {d:>4} {regs:>5} {spill:>5} {len(ins):>6} | main loop: "
                      f"{len(loop):>5} " + " ".join(f"{c:>5}" for c in counts))
                if args.ops == name:
                    print("   ", collections.Counter(loop).most_common())


if __name__ == "__main__":
    main()
