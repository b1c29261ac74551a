#!/usr/bin/env bash
# Builds what the GPU checks run (the CLI and every test binary that touches CUDA or NCCL, release,
# features cuda and mpi) and gathers it in target/gpu with tools/gpu/run.sh and the shared
# libraries a bare CUDA machine may lack (OpenMPI and its plugins, fontconfig...). The project's
# `device` tool then carries target/gpu to a GPU machine (no Rust toolchain there):
#   tools/gpu/pack.sh
#   run: carry ["target/gpu.tar.xz"], command
#        "tar xJf target/gpu.tar.xz -C target && bash target/gpu/session.sh 2>&1 | tee $OUT/log"
# See the knobs at the top of run.sh. REVS="rev ..." also builds the CLI at each git revision
# (exported by `git archive`, built in target/rev-build) as megatron-<rev>, so that one GPU run
# compares whole steps across commits: run.sh with BINS="megatron megatron-<rev>", or BENCH
# entries "name@megatron-<rev>:args". Each CLI adds about 20 MB to target/gpu (58 MB on
# 2026-11-30) and about 4 MB to the archive carried (12 MB; the device tool carries 64 MiB).
set -euo pipefail
cd "$(dirname "$0")/../.."
out=target/gpu
tests="cuda_nvrtc cuda_backend cuda_norm_softmax cuda_embedding_loss_adam cuda_layers_dense
       cuda_layers_attention_vocab cuda_moe_router gpt_gpu bench_gpu nccl_backend elementwise
       attention_general"
cargo build --release --locked --features cuda,mpi
cargo test --release --locked --workspace --features cuda,mpi --no-run --message-format=json \
    > target/gpu-tests.json
rm -rf "$out" && mkdir -p "$out/lib/openmpi"
cp target/release/megatron "$out/"
for t in $tests; do
    exe=$(python3 -c '
import json, sys
for line in open("target/gpu-tests.json"):
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m["target"]["name"] == sys.argv[1] \
            and m["target"]["kind"] == ["test"] and m.get("executable"):
        print(m["executable"])' "$t" | tail -1)
    [ -n "$exe" ] || { echo "no test binary $t" >&2; exit 1; }
    cp "$exe" "$out/$t"
done
(cd "$out" && strip megatron $tests)
# Libraries the binaries link beyond glibc, and OpenMPI's plugins with their helpers.
ldd "$out"/megatron "$out"/nccl_backend | awk '/=> \//{print $3}' | sort -u |
    grep -vE '/(libc|libm|libgcc_s|libpthread|libdl|librt|ld-linux[^/]*)\.so' |
    xargs -r cp -L -t "$out/lib/"
multiarch=/usr/lib/x86_64-linux-gnu
cp -L "$multiarch"/libevent-2.1.so.7 "$multiarch"/libmca_common_*.so "$out/lib/"
cp -rL "$multiarch/openmpi/lib/openmpi3" "$out/lib/openmpi/"
cp tools/gpu/run.sh tools/gpu/session.sh tools/gpu/graphs-lazy-loading.sh "$out/"
for rev in ${REVS:-}; do
    name=${rev//[^A-Za-z0-9._-]/_}
    src="target/rev-src/$name"
    rm -rf "$src" && mkdir -p "$src"
    # -m: files dated now, not at the commit (cargo compares dates with its last build's).
    git archive "$rev" | tar -x -m -C "$src"
    (cd "$src" && cargo build --release --locked --features cuda,mpi --target-dir "$OLDPWD/target/rev-build")
    cp target/rev-build/release/megatron "$out/megatron-$name"
    strip "$out/megatron-$name"
    rm -rf "$src"
done
du -sh "$out"
# The working tree and the binaries together pass the device tool's 64 MiB: carry an archive
# (carry ["target/gpu.tar.xz"], then `tar xJf target/gpu.tar.xz -C target` there first).
tar cJf target/gpu.tar.xz -C target gpu
du -sh target/gpu.tar.xz
