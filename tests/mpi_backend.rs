//! The MPI communicator under a real `mpirun -np 4` (OpenMPI): every collective against plain
//! rank-order folds (bit-exact), on the world and on subgroups; mismatches, timeouts and a failing
//! rank; and `megatron train --backend mpi` giving the thread backend's run bit for bit.
//!
//! Each test starts itself again under `mpirun` (the same test binary, filtered to that test);
//! the copies see `OMPI_COMM_WORLD_SIZE` and run the rank's body. A rank whose body fails or
//! panics aborts the whole job, which the parent reports with every rank's output.
#![cfg(feature = "mpi")]

#[cfg(feature = "cuda")]
#[path = "../megatron-core/tests/emulated/device.rs"]
mod device;

use std::path::Path;
use std::process::{Command, Output};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use half::{bf16, f16};
use megatron::comm::mpi::{MpiOptions, MpiWorld};
use megatron::comm::{CommError, Communicator, OpKind, ReduceOp, World};
use megatron::tensor::{DType, Tensor};

type R<T> = Result<T, Box<dyn std::error::Error + Send + Sync>>;

const RANKS: usize = 4;

/// `mpirun` with what a container needs: running as root, no single-copy shared memory.
fn mpirun(np: usize) -> Command {
    let mut cmd = Command::new("mpirun");
    cmd.args(["-np", &np.to_string(), "--oversubscribe"])
        .env("OMPI_ALLOW_RUN_AS_ROOT", "1")
        .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
        .env("OMPI_MCA_btl_vader_single_copy_mechanism", "none");
    cmd
}

/// Runs `cmd` (one `mpirun` at a time: the tests share the machine's cores).
fn output_of(mut cmd: Command) -> Output {
    static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());
    let _turn = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    cmd.output()
        .expect("mpirun could not be started: install OpenMPI (openmpi-bin libopenmpi-dev)")
}

fn text(out: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// In the parent: runs test `name` on `RANKS` MPI processes and returns their output.
/// In a copy started by `mpirun`: runs `body` on this rank and aborts the job if it fails.
fn on_ranks(name: &str, options: MpiOptions, body: fn(&MpiWorld) -> R<()>) -> Option<Output> {
    if std::env::var_os("OMPI_COMM_WORLD_SIZE").is_none() {
        return Some(this_test_on_ranks(name, &[]));
    }
    let world = MpiWorld::init_with(&options).expect("MPI world");
    let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| body(&world)));
    report(&world, result);
    None
}

/// Runs test `name` of this binary (with `extra` test flags) on `RANKS` MPI processes.
fn this_test_on_ranks(name: &str, extra: &[&str]) -> Output {
    let mut cmd = mpirun(RANKS);
    cmd.arg(std::env::current_exe().expect("test binary path"))
        .args([name, "--exact", "--nocapture", "--test-threads=1"])
        .args(extra);
    output_of(cmd)
}

/// Prints that this rank passed, or aborts the job with why not.
fn report(world: &MpiWorld, result: std::thread::Result<R<()>>) {
    match result {
        Ok(Ok(())) => println!("rank {} passed", world.rank()),
        Ok(Err(e)) => {
            eprintln!("rank {} failed: {e}", world.rank());
            world.abort(3)
        }
        Err(_) => {
            eprintln!("rank {} panicked", world.rank());
            world.abort(4)
        }
    }
}

/// [`on_ranks`] for a body on the NCCL world (each process on its GPU, the emulated one with
/// `MEGATRON_EMULATED_GPU=1`, which the `mpirun` copies inherit).
#[cfg(feature = "cuda")]
fn on_nccl_ranks(
    name: &str,
    body: fn(&megatron::comm::nccl::NcclWorld) -> R<()>,
) -> Option<Output> {
    if std::env::var_os("OMPI_COMM_WORLD_SIZE").is_none() {
        // The copies run the test though it is ignored (it is, without a GPU).
        return Some(this_test_on_ranks(name, &["--include-ignored"]));
    }
    device::install_if_requested(Path::new(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/megatron-core"
    )));
    let mpi = MpiWorld::init_with(&MpiOptions::default()).expect("MPI world");
    let world = megatron::comm::nccl::NcclWorld::init(mpi).expect("NCCL world");
    let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| body(&world)));
    report(world.mpi(), result);
    None
}

/// Asserts that every rank of the job passed.
fn assert_passed(out: Option<Output>) {
    let Some(out) = out else { return };
    let all = text(&out);
    assert!(out.status.success(), "mpirun failed:\n{all}");
    for r in 0..RANKS {
        assert!(all.contains(&format!("rank {r} passed")), "{all}");
    }
}

/// A deterministic value for (rank, element): distinct, not round, positive and negative.
fn value(rank: usize, i: usize) -> f32 {
    let x = (rank * 7919 + i * 104_729) % 1000;
    (x as f32 - 500.0) / 64.0 + 0.001 * i as f32
}

/// `values` as a tensor of `dtype` (integers for i64).
fn tensor_of(values: &[f32], dtype: DType) -> R<Tensor> {
    let n = values.len();
    Ok(match dtype {
        DType::F32 => Tensor::from_vec(values.to_vec(), [n])?,
        DType::BF16 => Tensor::from_vec(values.iter().map(|&v| bf16::from_f32(v)).collect(), [n])?,
        DType::F16 => Tensor::from_vec(values.iter().map(|&v| f16::from_f32(v)).collect(), [n])?,
        DType::I64 => Tensor::from_vec(values.iter().map(|&v| (v * 64.0) as i64).collect(), [n])?,
    })
}

/// The element values of `t` (on the host or a GPU) as u64 bit patterns, for bit-exact
/// comparisons.
fn bits(t: &Tensor) -> R<Vec<u64>> {
    #[cfg(feature = "cuda")]
    let t = t.to_host()?;
    Ok(match t.dtype() {
        DType::F32 => t
            .to_vec::<f32>()?
            .iter()
            .map(|v| v.to_bits().into())
            .collect(),
        DType::BF16 => t
            .to_vec::<bf16>()?
            .iter()
            .map(|v| v.to_bits().into())
            .collect(),
        DType::F16 => t
            .to_vec::<f16>()?
            .iter()
            .map(|v| v.to_bits().into())
            .collect(),
        DType::I64 => t.to_vec::<i64>()?.iter().map(|&v| v as u64).collect(),
    })
}

/// The reference reduction: element-wise over `inputs` in order, in f32 (exact in i64), rounded
/// once to the dtype.
fn fold(inputs: &[Tensor], op: ReduceOp) -> R<Vec<u64>> {
    let dtype = inputs[0].dtype();
    if dtype == DType::I64 {
        let vals: Vec<Vec<i64>> = inputs
            .iter()
            .map(|t| t.to_vec())
            .collect::<Result<_, _>>()?;
        let out: Vec<i64> = (0..vals[0].len())
            .map(|i| {
                let mut col = vals.iter().map(|v| v[i]);
                let first = col.next().unwrap_or(0);
                col.fold(first, |a, b| match op {
                    ReduceOp::Sum => a + b,
                    ReduceOp::Max => a.max(b),
                    ReduceOp::Min => a.min(b),
                })
            })
            .collect();
        return bits(&Tensor::from_vec(out, [inputs[0].numel()])?);
    }
    let vals: Vec<Vec<f32>> = inputs
        .iter()
        .map(|t| t.to_vec_f32())
        .collect::<Result<_, _>>()?;
    let out: Vec<f32> = (0..vals[0].len())
        .map(|i| {
            let mut col = vals.iter().map(|v| v[i]);
            let first = col.next().unwrap_or(0.0);
            col.fold(first, |a, b| match op {
                ReduceOp::Sum => a + b,
                ReduceOp::Max => a.max(b),
                ReduceOp::Min => a.min(b),
            })
        })
        .collect();
    bits(&Tensor::from_vec(out, [inputs[0].numel()])?.to_dtype(dtype)?)
}

/// What group rank `g` holds before a collective: `len` values of `dtype`.
fn input(g: usize, len: usize, dtype: DType, salt: usize) -> R<Tensor> {
    let vals: Vec<f32> = (0..len).map(|i| value(g + 10 * salt, i)).collect();
    tensor_of(&vals, dtype)
}

/// Where a check's tensors live (moved there from the host) and whether its floating-point sums
/// are the reference folds bit for bit (NCCL's are not: it adds in its own order).
struct Place<'a> {
    to: &'a dyn Fn(Tensor) -> R<Tensor>,
    exact_float_sums: bool,
}

/// Host tensors, every result bit for bit.
const HOST: Place<'static> = Place {
    to: &Ok,
    exact_float_sums: true,
};

/// Every collective on `c`, for every dtype, op and size, against the folds of all members'
/// inputs (which every rank rebuilds itself), with tensors where `place` puts them.
fn check_collectives(c: &dyn Communicator, place: &Place) -> R<()> {
    let n = c.size();
    let me = c.index();
    let at = |t: Tensor| (place.to)(t);
    for (salt, dtype) in DType::ALL.into_iter().enumerate() {
        for len in [1, 3, 4096 * 3 + 5, 70_001] {
            let all: Vec<Tensor> = (0..n)
                .map(|g| input(g, len, dtype, salt))
                .collect::<R<_>>()?;
            for op in [ReduceOp::Sum, ReduceOp::Max, ReduceOp::Min] {
                if op == ReduceOp::Sum && dtype != DType::I64 && !place.exact_float_sums {
                    continue;
                }
                let t = at(all[me].deep_clone()?)?;
                c.all_reduce(&t, op)?;
                assert_eq!(
                    bits(&t)?,
                    fold(&all, op)?,
                    "all-reduce {op:?} {dtype} × {len}"
                );

                // Reduce-scatter over n × len elements: slot `me` of the reduction.
                let wide: Vec<Tensor> = (0..n)
                    .map(|g| input(g, n * len, dtype, salt + 1))
                    .collect::<R<_>>()?;
                let out = at(Tensor::zeros([len], dtype))?;
                c.reduce_scatter(&at(wide[me].deep_clone()?)?, &out, op)?;
                let full = fold(&wide, op)?;
                assert_eq!(bits(&out)?, full[me * len..(me + 1) * len].to_vec());
                // In place: the output is this rank's slot of the input.
                let buf = at(wide[me].deep_clone()?)?;
                let slot = buf.narrow(0, me * len, len)?;
                c.reduce_scatter(&buf, &slot, op)?;
                assert_eq!(bits(&slot)?, full[me * len..(me + 1) * len].to_vec());
            }
            let gathered = at(Tensor::zeros([n * len], dtype))?;
            c.all_gather(&at(all[me].deep_clone()?)?, &gathered)?;
            let expected: Vec<u64> = all.iter().map(bits).collect::<R<Vec<_>>>()?.concat();
            assert_eq!(bits(&gathered)?, expected, "all-gather {dtype} × {len}");
            let in_place = Tensor::zeros([n * len], dtype);
            in_place.narrow(0, me * len, len)?.copy_from(&all[me])?;
            let in_place = at(in_place)?;
            c.all_gather(&in_place.narrow(0, me * len, len)?, &in_place)?;
            assert_eq!(bits(&in_place)?, expected, "in-place all-gather");

            for root in 0..n {
                let t = at(all[me].deep_clone()?)?;
                c.broadcast(&t, root)?;
                assert_eq!(bits(&t)?, bits(&all[root])?, "broadcast from {root}");
            }
        }
        // Uneven all-to-all: rank i sends (i + j) % 3 + j elements to rank j.
        let split = |i: usize, j: usize| (i + j) % 3 + j;
        let send: Vec<usize> = (0..n).map(|j| split(me, j)).collect();
        let recv: Vec<usize> = (0..n).map(|i| split(i, me)).collect();
        let inputs: Vec<Tensor> = (0..n)
            .map(|g| input(g, (0..n).map(|j| split(g, j)).sum(), dtype, salt))
            .collect::<R<_>>()?;
        let output = at(Tensor::zeros([recv.iter().sum::<usize>()], dtype))?;
        c.all_to_all(&at(inputs[me].deep_clone()?)?, &send, &output, &recv)?;
        let mut expected = Vec::new();
        for (i, input) in inputs.iter().enumerate() {
            let start: usize = (0..me).map(|j| split(i, j)).sum();
            expected.extend_from_slice(&bits(input)?[start..start + split(i, me)]);
        }
        assert_eq!(bits(&output)?, expected, "all-to-all {dtype}");
    }
    // Started collectives (on the progress thread; over NCCL on the communication stream),
    // several in flight at once, then a blocking one after them: each the rank-order fold.
    {
        let len = 4096 * 3 + 5;
        let op = if place.exact_float_sums {
            ReduceOp::Sum
        } else {
            ReduceOp::Max
        };
        let all: Vec<Tensor> = (0..n)
            .map(|g| input(g, len, DType::F32, 9))
            .collect::<R<_>>()?;
        let wide: Vec<Tensor> = (0..n)
            .map(|g| input(g, n * len, DType::F32, 10))
            .collect::<R<_>>()?;
        let reduced = at(all[me].deep_clone()?)?;
        let scattered = at(Tensor::zeros([len], DType::F32))?;
        let gathered = at(Tensor::zeros([n * len], DType::F32))?;
        let started = [
            c.start_all_reduce(&reduced, op)?,
            c.start_reduce_scatter(&at(wide[me].deep_clone()?)?, &scattered, op)?,
            c.start_all_gather(&at(all[me].deep_clone()?)?, &gathered)?,
        ];
        let after = at(all[me].deep_clone()?)?;
        c.all_reduce(&after, ReduceOp::Max)?;
        for pending in started {
            pending.wait()?;
        }
        assert_eq!(bits(&reduced)?, fold(&all, op)?, "started all-reduce");
        let full = fold(&wide, op)?;
        assert_eq!(bits(&scattered)?, full[me * len..(me + 1) * len].to_vec());
        let expected: Vec<u64> = all.iter().map(bits).collect::<R<Vec<_>>>()?.concat();
        assert_eq!(bits(&gathered)?, expected, "started all-gather");
        assert_eq!(bits(&after)?, fold(&all, ReduceOp::Max)?);
    }
    // Point to point around the ring, both ways, several messages in order.
    if n > 1 {
        let next = (me + 1) % n;
        let prev = (me + n - 1) % n;
        for k in 0..3 {
            let out = at(input(me, 100 + k, DType::F32, k)?)?;
            let got = at(Tensor::zeros([100 + k], DType::F32))?;
            if me.is_multiple_of(2) {
                c.send(&out, next)?;
                c.recv(&got, prev)?;
            } else {
                c.recv(&got, prev)?;
                c.send(&out, next)?;
            }
            assert_eq!(bits(&got)?, bits(&input(prev, 100 + k, DType::F32, k)?)?);
        }
        // One exchange, every rank sending first: around the ring both ways (one way for a
        // pair), messages larger than any library buffers (sends that wait for their receive
        // complete only because the batch holds both ends).
        const LEN: usize = 50_000;
        let to_next = at(input(me, LEN, DType::F32, 7)?)?;
        let to_prev = at(input(me, LEN, DType::F32, 8)?)?;
        let from_prev = at(Tensor::zeros([LEN], DType::F32))?;
        let from_next = at(Tensor::zeros([LEN], DType::F32))?;
        if n > 2 {
            c.exchange(
                &[(&to_next, next), (&to_prev, prev)],
                &[(&from_prev, prev), (&from_next, next)],
            )?;
            assert_eq!(bits(&from_next)?, bits(&input(next, LEN, DType::F32, 8)?)?);
        } else {
            c.exchange(&[(&to_next, next)], &[(&from_prev, prev)])?;
        }
        assert_eq!(bits(&from_prev)?, bits(&input(prev, LEN, DType::F32, 7)?)?);
    }
    Ok(c.barrier()?)
}

#[test]
fn collectives_on_the_world_and_subgroups_equal_rank_order_folds() {
    assert_passed(on_ranks(
        "collectives_on_the_world_and_subgroups_equal_rank_order_folds",
        MpiOptions::default(),
        |w| {
            assert_eq!(w.size(), RANKS);
            assert_eq!(w.local_size(), RANKS);
            let world = w.communicator("world", &[0, 1, 2, 3])?;
            check_collectives(world.as_ref(), &HOST)?;
            // Pairs in a non-sorted member order: group rank 0 of [3, 1] is global rank 3.
            let pair: &[usize] = if w.rank() % 2 == 1 { &[3, 1] } else { &[0, 2] };
            let c = w.communicator("pair", pair)?;
            assert_eq!(c.ranks(), pair);
            assert_eq!(c.index(), pair.iter().position(|&r| r == w.rank()).unwrap());
            check_collectives(c.as_ref(), &HOST)?;
            // A group of one is a copy.
            let solo = w.communicator("solo", &[w.rank()])?;
            check_collectives(solo.as_ref(), &HOST)?;
            // The same group asked for again is the same communicator (its counters went on).
            let again = w.communicator("world", &[0, 1, 2, 3])?;
            assert!(again.stats().get(OpKind::AllReduce).calls > 0);
            Ok(())
        },
    ));
}

/// Collectives started on one group run on the rank's progress thread: `start_` returns
/// before a late peer arrives, the data moves while the rank's thread computes (no MPI call on
/// it), the rank's blocking calls on another group go on meanwhile without a deadlock between
/// the processes' MPI locks, and a later blocking call on the same group comes after the
/// started ones. Every result is the rank-order fold.
#[test]
fn started_collectives_progress_while_the_rank_computes() {
    assert_passed(on_ranks(
        "started_collectives_progress_while_the_rank_computes",
        MpiOptions::default(),
        |w| {
            let me = w.rank();
            // Columns {0, 2} and {1, 3} start; rows {0, 1} and {2, 3} call meanwhile.
            let col_ranks = [me % 2, me % 2 + 2];
            let col = w.communicator("col", &col_ranks)?;
            let row = w.communicator("row", &[me / 2 * 2, me / 2 * 2 + 1])?;
            let (n, len) = (2, 300_001);
            let all: Vec<Tensor> = col_ranks
                .iter()
                .map(|&g| input(g, len, DType::F32, 1))
                .collect::<R<_>>()?;
            let mine = col.index();
            let late = Duration::from_millis(300);
            if mine == 1 {
                std::thread::sleep(late);
            }
            let begun = Instant::now();
            let ran = std::sync::Arc::new(Mutex::new(None));
            let summed = all[mine].deep_clone()?;
            let record = ran.clone();
            let pending = col
                .start_all_reduce(&summed, ReduceOp::Sum)?
                .then(move |interval| *record.lock().unwrap() = Some(interval));
            let wide: Vec<Tensor> = col_ranks
                .iter()
                .map(|&g| input(g, n * len, DType::F32, 2))
                .collect::<R<_>>()?;
            let scattered = Tensor::zeros([len], DType::F32);
            let scatter = col.start_reduce_scatter(&wide[mine], &scattered, ReduceOp::Sum)?;
            let gathered = Tensor::zeros([n * len], DType::F32);
            let gather = col.start_all_gather(&all[mine], &gathered)?;
            if mine == 0 {
                assert!(
                    begun.elapsed() < late,
                    "start_ waited {:?} for the late peer",
                    begun.elapsed()
                );
            }
            // Calls on the other group go on while the column's collectives are in flight.
            for salt in 0..3 {
                let t = input(me, 1000, DType::F32, salt)?;
                row.all_reduce(&t, ReduceOp::Sum)?;
                let rows = [me / 2 * 2, me / 2 * 2 + 1].map(|g| input(g, 1000, DType::F32, salt));
                assert_eq!(
                    bits(&t)?,
                    fold(&rows.into_iter().collect::<R<Vec<_>>>()?, ReduceOp::Sum)?
                );
            }
            // Compute, making no MPI call: the progress thread moves the data meanwhile.
            let computing = Instant::now();
            let mut x = 0u64;
            while computing.elapsed() < Duration::from_millis(1500) {
                x = x.wrapping_mul(6364136223846793005).wrapping_add(1);
            }
            std::hint::black_box(x);
            let waited = Instant::now();
            pending.wait()?;
            let (start, end) = ran.lock().unwrap().expect("the hook saw the interval");
            assert!(
                end < waited,
                "the started all-reduce ran {:?} after the rank stopped computing",
                end - waited.min(end)
            );
            if mine == 0 {
                assert!(end.duration_since(start) + Duration::from_millis(50) >= late / 2);
            }
            scatter.wait()?;
            gather.wait()?;
            // A blocking call on the column after the started ones.
            let last = input(me, 10, DType::F32, 5)?;
            col.all_reduce(&last, ReduceOp::Sum)?;
            assert_eq!(bits(&summed)?, fold(&all, ReduceOp::Sum)?);
            let full = fold(&wide, ReduceOp::Sum)?;
            assert_eq!(
                bits(&scattered)?,
                full[mine * len..(mine + 1) * len].to_vec()
            );
            let expected: Vec<u64> = all.iter().map(bits).collect::<R<Vec<_>>>()?.concat();
            assert_eq!(bits(&gathered)?, expected);
            let lasts = col_ranks.map(|g| input(g, 10, DType::F32, 5));
            assert_eq!(
                bits(&last)?,
                fold(&lasts.into_iter().collect::<R<Vec<_>>>()?, ReduceOp::Sum)?
            );
            Ok(())
        },
    ));
}

#[test]
fn counters_record_calls_and_bytes() {
    assert_passed(on_ranks(
        "counters_record_calls_and_bytes",
        MpiOptions::default(),
        |w| {
            let c = w.communicator("world", &[0, 1, 2, 3])?;
            c.all_reduce(&Tensor::zeros([10], DType::F32), ReduceOp::Sum)?;
            c.all_reduce(&Tensor::zeros([6], DType::BF16), ReduceOp::Max)?;
            c.all_gather(
                &Tensor::zeros([2], DType::F32),
                &Tensor::zeros([8], DType::F32),
            )?;
            let s = c.stats();
            assert_eq!(s.get(OpKind::AllReduce).calls, 2);
            assert_eq!(s.get(OpKind::AllReduce).bytes, 40 + 12);
            assert_eq!(s.get(OpKind::AllGather).calls, 1);
            assert_eq!(s.get(OpKind::Broadcast).calls, 0);
            Ok(())
        },
    ));
}

#[test]
fn mismatched_calls_are_errors_on_every_rank_and_the_group_goes_on() {
    assert_passed(on_ranks(
        "mismatched_calls_are_errors_on_every_rank_and_the_group_goes_on",
        MpiOptions::default(),
        |w| {
            let c = w.communicator("world", &[0, 1, 2, 3])?;
            let len = if w.rank() == 2 { 6 } else { 5 };
            let err = c
                .all_reduce(&Tensor::zeros([len], DType::F32), ReduceOp::Sum)
                .expect_err("sizes differ");
            let msg = err.to_string();
            assert!(matches!(err, CommError::Mismatch { .. }), "{msg}");
            assert!(msg.contains("f32 × 5") && msg.contains("f32 × 6"), "{msg}");
            assert!(msg.contains("rank 2"), "{msg}");

            let err = if w.rank() == 0 {
                c.broadcast(&Tensor::zeros([4], DType::F32), 0)
            } else {
                c.all_reduce(&Tensor::zeros([4], DType::F32), ReduceOp::Sum)
            }
            .expect_err("different collectives");
            assert!(err.to_string().contains("broadcast"), "{err}");

            // Nothing moved: the next matching call works.
            let t = Tensor::full([5], 1.0, DType::F32);
            c.all_reduce(&t, ReduceOp::Sum)?;
            assert_eq!(t.to_vec::<f32>()?, vec![4.0; 5]);

            // A message of another size is an error for the receiver, naming both.
            let pair = if w.rank() < 2 { [0, 1] } else { [2, 3] };
            let p = w.communicator("p2p", &pair)?;
            if p.index() == 0 {
                p.send(&Tensor::zeros([7], DType::F32), 1)?;
            } else {
                let err = p
                    .recv(&Tensor::zeros([8], DType::F32), 0)
                    .expect_err("sizes differ");
                assert!(err.to_string().contains("7"), "{err}");
                assert!(err.to_string().contains("8"), "{err}");
            }
            Ok(())
        },
    ));
}

#[test]
fn a_rank_that_never_comes_is_a_timeout_naming_it() {
    assert_passed(on_ranks(
        "a_rank_that_never_comes_is_a_timeout_naming_it",
        MpiOptions {
            timeout: Duration::from_millis(1500),
        },
        |w| {
            let c = w.communicator("world", &[0, 1, 2, 3])?;
            if w.rank() != 3 {
                let start = Instant::now();
                let err = c
                    .all_reduce(&Tensor::zeros([4], DType::F32), ReduceOp::Sum)
                    .expect_err("rank 3 never calls");
                let msg = err.to_string();
                match err {
                    CommError::Timeout { missing, .. } => assert_eq!(missing, vec![3], "{msg}"),
                    other => panic!("expected a timeout, got {other}"),
                }
                assert!(start.elapsed() < Duration::from_secs(10), "{msg}");
                // The group is unusable after a timeout (MPI may still hold its messages).
                let again = c.barrier().expect_err("broken group");
                assert!(matches!(again, CommError::Timeout { .. }), "{again}");
            } else {
                std::thread::sleep(Duration::from_millis(2500));
            }
            // Other groups still work.
            let fresh = w.communicator("after", &[0, 1, 2, 3])?;
            let t = Tensor::full([3], w.rank() as f32, DType::F32);
            fresh.all_reduce(&t, ReduceOp::Max)?;
            assert_eq!(t.to_vec::<f32>()?, vec![3.0; 3]);
            Ok(())
        },
    ));
}

#[test]
fn a_failing_rank_stops_every_process() {
    let started = Instant::now();
    let out = on_ranks(
        "a_failing_rank_stops_every_process",
        MpiOptions::default(),
        |w| {
            let c = w.communicator("world", &[0, 1, 2, 3])?;
            if w.rank() == 1 {
                return Err("rank 1 gives up".into());
            }
            // The others wait in a collective rank 1 never joins (the default timeout is
            // minutes): only the abort ends them.
            c.all_reduce(&Tensor::zeros([4], DType::F32), ReduceOp::Sum)?;
            Ok(())
        },
    );
    let Some(out) = out else { return };
    let all = text(&out);
    assert!(!out.status.success(), "{all}");
    assert!(all.contains("rank 1 failed: rank 1 gives up"), "{all}");
    assert!(started.elapsed() < Duration::from_secs(60), "{all}");
}

/// Runs `megatron train` with `args` and returns its JSON log's lines without timings.
fn train_log(mut cmd: Command, log: &Path, args: &[&str]) -> Vec<String> {
    cmd.args(["train", "--model", "gpt-tiny", "--quiet", "--log-json"])
        .arg(log)
        .args(args);
    let out = output_of(cmd);
    assert!(out.status.success(), "{}", text(&out));
    let lines: Vec<String> = std::fs::read_to_string(log)
        .expect("the log")
        .lines()
        .map(|l| {
            let mut v: serde_json::Value = serde_json::from_str(l).expect("JSON line");
            v.as_object_mut().expect("object").remove("tokens_per_s");
            v.to_string()
        })
        .collect();
    assert!(!lines.is_empty());
    lines
}

fn scratch_dir(name: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("megatron-mpi-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("scratch dir");
    dir
}

#[test]
fn training_under_mpirun_equals_training_on_threads() {
    if std::env::var_os("OMPI_COMM_WORLD_SIZE").is_some() {
        return;
    }
    let args = [
        "--tp",
        "2",
        "--dp",
        "2",
        "--train-iters",
        "4",
        "--global-batch-size",
        "8",
        "--seq-length",
        "64",
        "--eval-interval",
        "2",
        "--eval-iters",
        "2",
    ];
    processes_train_as_threads("train", &args, "mpi", &[]);
}

/// `--overlap-grad-reduce` and `--overlap-param-gather` under `mpirun`, the started
/// collectives on each process's progress threads (the reduction started in the hook of the
/// gradient that completes its bucket, the gather after the optimizer step), train as thread
/// ranks: pp 2 × dp 2 with the distributed optimizer's reduce-scatters and the tied embedding's
/// buckets after its sum; tp 2 with sequence parallelism × dp 2, whose tensor-parallel calls
/// run on the rank's thread while its data-parallel ones are in flight; and dp 4 with two
/// distributed-optimizer instances.
#[test]
fn overlapped_reduction_under_mpirun_equals_thread_ranks() {
    if std::env::var_os("OMPI_COMM_WORLD_SIZE").is_some() {
        return;
    }
    let args = [
        "--pp",
        "2",
        "--dp",
        "2",
        "--use-distributed-optimizer",
        "--overlap-grad-reduce",
        "--overlap-param-gather",
        "--ddp-bucket-size",
        "20000",
        "--train-iters",
        "3",
        "--global-batch-size",
        "8",
        "--seq-length",
        "64",
    ];
    processes_train_as_threads("overlap", &args, "mpi", &[]);
    let tensor_parallel = [
        "--tp",
        "2",
        "--sequence-parallel",
        "--dp",
        "2",
        "--overlap-grad-reduce",
        "--ddp-bucket-size",
        "20000",
        "--train-iters",
        "3",
        "--global-batch-size",
        "8",
        "--seq-length",
        "64",
    ];
    processes_train_as_threads("overlap-tp", &tensor_parallel, "mpi", &[]);
    // Two distributed-optimizer instances: reduce-scatters within each, then the shards'
    // all-reduces across them.
    let instances = [
        "--dp",
        "4",
        "--use-distributed-optimizer",
        "--num-distributed-optimizer-instances",
        "2",
        "--overlap-grad-reduce",
        "--overlap-param-gather",
        "--ddp-bucket-size",
        "20000",
        "--train-iters",
        "3",
        "--global-batch-size",
        "16",
        "--seq-length",
        "64",
    ];
    processes_train_as_threads("overlap-instances", &instances, "mpi", &[]);
    // Sharded gradients (optim_grads): every micro-batch's reduce-scatter per bucket, over a
    // pipeline whose tied embedding's bucket is summed over both ends first; overlapped and
    // not (the reductions then run at once, inside the backward).
    // Sharded parameters (optim_grads_params): each unit's gather, the next prefetched with
    // the overlap.
    for (name, strategy, overlap) in [
        ("sharded-grads", "optim_grads", &[][..]),
        (
            "sharded-grads-overlap",
            "optim_grads",
            &["--overlap-grad-reduce", "--overlap-param-gather"][..],
        ),
        ("sharded-params", "optim_grads_params", &[][..]),
        (
            "sharded-params-overlap",
            "optim_grads_params",
            &["--overlap-grad-reduce", "--overlap-param-gather"][..],
        ),
    ] {
        let sharded = [
            &[
                "--pp",
                "2",
                "--dp",
                "2",
                "--data-parallel-sharding-strategy",
                strategy,
                "--ddp-bucket-size",
                "20000",
                "--train-iters",
                "3",
                "--global-batch-size",
                "8",
                "--seq-length",
                "64",
            ][..],
            overlap,
        ]
        .concat();
        processes_train_as_threads(name, &sharded, "mpi", &[]);
    }
}

/// `--trace` under `mpirun`: each process records its rank's step, and rank 0 gathers them
/// over the world into one Chrome trace of the four ranks, each with its passes and the
/// collectives of its groups.
#[test]
fn a_trace_under_mpirun_holds_every_process() {
    if std::env::var_os("OMPI_COMM_WORLD_SIZE").is_some() {
        return;
    }
    let dir = scratch_dir("trace");
    let path = dir.join("trace.json");
    let mut mpi = megatron_under_mpirun(4, &[]);
    mpi.args([
        "train",
        "--model",
        "gpt-tiny",
        "--quiet",
        "--backend",
        "mpi",
    ])
    .args(["--tp", "2", "--dp", "2", "--train-iters", "2", "--trace"])
    .arg(&path);
    let out = output_of(mpi);
    assert!(out.status.success(), "{}", text(&out));
    let trace: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).expect("the trace")).expect("JSON");
    let spans: Vec<&serde_json::Value> = trace["traceEvents"]
        .as_array()
        .expect("events")
        .iter()
        .filter(|e| e["ph"] == "X")
        .collect();
    for rank in 0..4u64 {
        let mine = |cat: &str| {
            spans
                .iter()
                .filter(|e| e["pid"] == rank && e["cat"] == cat)
                .count()
        };
        assert!(
            mine("step") == 5 && mine("compute") >= 2 && mine("comm") > 0,
            "rank {rank}: {} {} {}",
            mine("step"),
            mine("compute"),
            mine("comm")
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// The Llama family's blocks between processes (mixtral-tiny: RMSNorm, grouped-query
/// attention with rotary embeddings, SwiGLU experts over ep 2, the untied output layer; and the
/// qk-layernorm, its weights' gradients summed over tp) at tp 2 with sequence parallelism × pp
/// 2, as on thread ranks.
#[test]
fn llama_training_under_mpirun_equals_thread_ranks() {
    if std::env::var_os("OMPI_COMM_WORLD_SIZE").is_some() {
        return;
    }
    let args = [
        "--model",
        "mixtral-tiny",
        "--qk-layernorm",
        "--tp",
        "2",
        "--sequence-parallel",
        "--ep",
        "2",
        "--pp",
        "2",
        "--train-iters",
        "3",
        "--global-batch-size",
        "8",
        "--seq-length",
        "64",
    ];
    processes_train_as_threads("llama", &args, "mpi", &[]);
}

/// DeepSeek-V3's blocks between processes (deepseek-v3-tiny: multi-latent attention with its
/// rotary key gathered over tp, YaRN, a dense first layer, group-limited sigmoid routing with
/// the expert bias beside a shared expert, a depth of multi-token prediction) at tp 2 with
/// sequence parallelism, ep 2 and pp 2 (a stage of the dense layer and one MoE layer, a stage of
/// MoE layers and the depth, which looks up the untied embedding the first stage holds too), as
/// on thread ranks.
#[test]
fn deepseek_training_under_mpirun_equals_thread_ranks() {
    if std::env::var_os("OMPI_COMM_WORLD_SIZE").is_some() {
        return;
    }
    let args = [
        "--model",
        "deepseek-v3-tiny",
        "--mtp-num-layers",
        "1",
        "--tp",
        "2",
        "--sequence-parallel",
        "--ep",
        "2",
        "--pp",
        "2",
        "--train-iters",
        "3",
        "--global-batch-size",
        "8",
        "--seq-length",
        "64",
    ];
    processes_train_as_threads("deepseek", &args, "mpi", &[]);
}

/// Context parallelism between processes: cp 2 × tp 2 with attention's keys and values
/// all-gathered (their gradients reduce-scattered) and round a ring, and cp 4 with the
/// hierarchical all-to-all inside pairs and a ring across them, through MPI; the gradients
/// reduced over the data×context-parallel group, as on thread ranks.
#[test]
fn context_parallel_training_under_mpirun_equals_thread_ranks() {
    if std::env::var_os("OMPI_COMM_WORLD_SIZE").is_some() {
        return;
    }
    let common = [
        "--train-iters",
        "3",
        "--global-batch-size",
        "8",
        "--seq-length",
        "64",
        "--attention-dropout",
        "0.1",
    ];
    for (name, flags) in [
        ("cp-all-gather", &["--cp", "2", "--tp", "2"][..]),
        (
            "cp-p2p",
            &["--cp", "2", "--tp", "2", "--cp-comm-type", "p2p"],
        ),
        (
            "cp-a2a-p2p",
            &[
                "--cp",
                "4",
                "--cp-comm-type",
                "a2a+p2p",
                "--hierarchical-context-parallel-sizes",
                "2",
                "2",
            ],
        ),
    ] {
        processes_train_as_threads(name, &[&common[..], flags].concat(), "mpi", &[]);
    }
}

/// Sequence parallelism between processes: the shards' all-gathers and reduce-scatters through
/// `MPI_Allgather` and `MPI_Reduce_scatter`, the norms' gradients summed over tp, as on thread
/// ranks.
#[test]
fn sequence_parallel_training_under_mpirun_equals_thread_ranks() {
    if std::env::var_os("OMPI_COMM_WORLD_SIZE").is_some() {
        return;
    }
    let args = [
        "--tp",
        "2",
        "--dp",
        "2",
        "--sequence-parallel",
        "--train-iters",
        "3",
        "--global-batch-size",
        "8",
        "--seq-length",
        "64",
    ];
    processes_train_as_threads("sp", &args, "mpi", &[]);
}

/// A MoE GPT with its experts split over two processes of each four (ep 2, edp 2): the
/// dispatcher's uneven all-to-alls through `MPI_Alltoallv`, the experts' gradients reduced and
/// sharded over the expert data-parallel pairs, as on thread ranks (the log's routing statistics
/// included).
#[test]
fn moe_training_under_mpirun_equals_thread_ranks() {
    if std::env::var_os("OMPI_COMM_WORLD_SIZE").is_some() {
        return;
    }
    let args = [
        "--model",
        "gpt-moe-tiny",
        "--dp",
        "4",
        "--ep",
        "2",
        "--use-distributed-optimizer",
        "--moe-expert-capacity-factor",
        "1.5",
        "--moe-z-loss-coeff",
        "0.001",
        "--train-iters",
        "3",
        "--micro-batch-size",
        "2",
        "--global-batch-size",
        "16",
        "--seq-length",
        "64",
    ];
    processes_train_as_threads("moe", &args, "mpi", &[]);
}

/// The distributed optimizer over four data-parallel processes: gradients reduce-scattered and
/// parameters all-gathered over MPI, bucket by bucket, as on thread ranks.
#[test]
fn the_distributed_optimizer_under_mpirun_equals_thread_ranks() {
    if std::env::var_os("OMPI_COMM_WORLD_SIZE").is_some() {
        return;
    }
    // Each process writes its shard of the optimizer state at the end.
    let save = scratch_dir("distopt-save").join("ckpt");
    let save = save.to_str().expect("a UTF-8 path");
    let args = [
        "--dp",
        "4",
        "--use-distributed-optimizer",
        "--ddp-bucket-size",
        "100000",
        "--train-iters",
        "3",
        "--global-batch-size",
        "8",
        "--micro-batch-size",
        "1",
        "--seq-length",
        "64",
        "--save",
        save,
    ];
    processes_train_as_threads("distopt", &args, "mpi", &[]);
    // The processes' checkpoint (written last) holds four shards and resumes on threads.
    let iteration = format!("{save}/iter_0000003");
    for rank in 0..4 {
        let shard = format!("{iteration}/optimizer.rank{rank:05}.safetensors");
        assert!(Path::new(&shard).is_file(), "{shard}");
    }
    let mut resume = Command::new(env!("CARGO_BIN_EXE_megatron"));
    resume.args([
        "train",
        "--quiet",
        "--load",
        &iteration,
        "--train-iters",
        "4",
    ]);
    let out = output_of(resume);
    assert!(out.status.success(), "{}", text(&out));
}

/// Mixed precision over MPI: fp16 parameters and gradients (16-bit messages: the gradients'
/// reduce-scatter and the parameters' all-gather) with dynamic loss scaling, whose first steps
/// overflow and are skipped by every process alike; and bf16 parameters with f32 gradients.
#[test]
fn sixteen_bit_training_under_mpirun_equals_thread_ranks() {
    if std::env::var_os("OMPI_COMM_WORLD_SIZE").is_some() {
        return;
    }
    for (name, precision) in [
        ("fp16", ["--fp16", "--initial-loss-scale", "262144"]),
        ("bf16", ["--bf16", "--loss-scale", "8"]),
    ] {
        let mut args = vec![
            "--tp",
            "2",
            "--dp",
            "2",
            "--use-distributed-optimizer",
            "--train-iters",
            "4",
            "--global-batch-size",
            "8",
            "--seq-length",
            "32",
        ];
        args.extend(precision);
        processes_train_as_threads(name, &args, "mpi", &[]);
    }
}

/// A pipeline of two stages, each of two tensor-parallel processes, with the interleaved
/// schedule: its activations and gradients go between processes over MPI.
#[test]
fn a_pipeline_under_mpirun_equals_the_pipeline_on_threads() {
    if std::env::var_os("OMPI_COMM_WORLD_SIZE").is_some() {
        return;
    }
    let args = [
        "--tp",
        "2",
        "--pp",
        "2",
        "--vpp",
        "2",
        "--num-layers",
        "4",
        "--train-iters",
        "3",
        "--global-batch-size",
        "8",
        "--micro-batch-size",
        "2",
        "--seq-length",
        "32",
        "--eval-interval",
        "2",
        "--eval-iters",
        "1",
    ];
    processes_train_as_threads("pipeline", &args, "mpi", &[]);
}

/// The zero-bubble schedules between processes, two stages of two tensor-parallel processes
/// each: ZB-H1, and ZB-V's V (the last rank handing its activations from one chunk to the
/// other, the first rank's two chunks both ends of the model), against the same pipelines of
/// thread ranks.
#[test]
fn zero_bubble_pipelines_under_mpirun_equal_them_on_threads() {
    if std::env::var_os("OMPI_COMM_WORLD_SIZE").is_some() {
        return;
    }
    for schedule in ["zb-h1", "zbv"] {
        let args = [
            "--tp",
            "2",
            "--pp",
            "2",
            "--pipeline-schedule",
            schedule,
            "--num-layers",
            "4",
            "--train-iters",
            "3",
            "--global-batch-size",
            "8",
            "--micro-batch-size",
            "2",
            "--seq-length",
            "32",
        ];
        processes_train_as_threads(schedule, &args, "mpi", &[]);
    }
}

/// Every collective and point-to-point call of the NCCL communicator between four processes,
/// on the world and on pairs, against the same folds as MPI's (floating-point sums excepted,
/// which NCCL adds in its own order; the training test below covers them): uneven all-to-all
/// as grouped sends and receives, in-place gathers and scatters, messages around the ring.
#[cfg(feature = "cuda")]
#[test]
#[ignore = "needs 4 GPUs and NCCL, or the emulated ones: MEGATRON_EMULATED_GPU=1"]
fn nccl_collectives_between_processes_equal_rank_order_folds() {
    assert_passed(on_nccl_ranks(
        "nccl_collectives_between_processes_equal_rank_order_folds",
        |w| {
            let gpu = w.gpu().clone();
            let on_gpu = move |t: Tensor| Ok(t.to_gpu(&gpu)?);
            let place = Place {
                to: &on_gpu,
                exact_float_sums: false,
            };
            let world = w.communicator("world", &[0, 1, 2, 3])?;
            check_collectives(world.as_ref(), &place)?;
            let pair: &[usize] = if w.rank() % 2 == 1 { &[3, 1] } else { &[0, 2] };
            check_collectives(w.communicator("pair", pair)?.as_ref(), &place)?;
            Ok(())
        },
    ));
}

/// `megatron train --backend nccl --device cuda` under `mpirun -np 4` (one process per GPU, the
/// groups' NCCL unique ids broadcast over MPI, all-reduces and point-to-point through NCCL)
/// follows the same run of four thread ranks sharing one GPU (the device-local communicator).
/// On the emulated GPU (`MEGATRON_EMULATED_GPU=1`) every process has its own, and NCCL runs
/// between the processes through shared memory.
#[cfg(feature = "cuda")]
#[test]
#[ignore = "needs 4 GPUs and NCCL, or the emulated ones: MEGATRON_EMULATED_GPU=1"]
fn training_with_nccl_under_mpirun_follows_thread_ranks_on_one_gpu() {
    if std::env::var_os("OMPI_COMM_WORLD_SIZE").is_some() {
        return;
    }
    let args = [
        "--tp",
        "2",
        "--dp",
        "2",
        "--train-iters",
        "3",
        "--global-batch-size",
        "8",
        "--seq-length",
        "64",
        "--device",
        "cuda",
    ];

    nccl_trains_as_threads("nccl", &args);
}

/// Sequence parallelism over NCCL: the shards' all-gathers and reduce-scatters between the
/// processes' GPUs follow the device-local communicator's on one GPU.
#[cfg(feature = "cuda")]
#[test]
#[ignore = "needs 4 GPUs and NCCL, or the emulated ones: MEGATRON_EMULATED_GPU=1"]
fn sequence_parallel_training_with_nccl_under_mpirun_follows_thread_ranks_on_one_gpu() {
    if std::env::var_os("OMPI_COMM_WORLD_SIZE").is_some() {
        return;
    }
    let args = [
        "--tp",
        "2",
        "--dp",
        "2",
        "--sequence-parallel",
        "--train-iters",
        "3",
        "--global-batch-size",
        "8",
        "--seq-length",
        "64",
        "--device",
        "cuda",
    ];
    nccl_trains_as_threads("nccl-sp", &args);
}

/// mixtral-tiny with the qk-layernorm over NCCL (tp 4 with sequence parallelism, each of its 2
/// key/value heads on two ranks; its SwiGLU experts over ep 2): the Llama blocks' and the
/// experts' kernels on each process's GPU, as thread ranks sharing one.
#[cfg(feature = "cuda")]
#[test]
#[ignore = "needs 4 GPUs and NCCL, or the emulated ones: MEGATRON_EMULATED_GPU=1"]
fn llama_training_with_nccl_under_mpirun_follows_thread_ranks_on_one_gpu() {
    if std::env::var_os("OMPI_COMM_WORLD_SIZE").is_some() {
        return;
    }
    let args = [
        "--model",
        "mixtral-tiny",
        "--qk-layernorm",
        "--tp",
        "4",
        "--ep",
        "2",
        "--sequence-parallel",
        "--train-iters",
        "3",
        "--global-batch-size",
        "8",
        "--seq-length",
        "64",
        "--device",
        "cuda",
    ];
    nccl_trains_as_threads("nccl-llama", &args);
}

/// Context parallelism over NCCL: llama-tiny at cp 4 with the all-to-all inside pairs and the
/// ring across them (its exchanges batched, so that sends that wait for their receives cannot
/// deadlock), and cp 2 × tp 2 with sequence parallelism round a ring, as thread ranks sharing
/// one GPU.
#[cfg(feature = "cuda")]
#[test]
#[ignore = "needs 4 GPUs and NCCL, or the emulated ones: MEGATRON_EMULATED_GPU=1"]
fn context_parallel_training_with_nccl_under_mpirun_follows_thread_ranks_on_one_gpu() {
    if std::env::var_os("OMPI_COMM_WORLD_SIZE").is_some() {
        return;
    }
    let common = [
        "--model",
        "llama-tiny",
        "--train-iters",
        "3",
        "--global-batch-size",
        "8",
        "--seq-length",
        "64",
        "--attention-dropout",
        "0.1",
        "--device",
        "cuda",
    ];
    for (name, flags) in [
        (
            "nccl-cp-a2a-p2p",
            &[
                "--cp",
                "4",
                "--cp-comm-type",
                "a2a+p2p",
                "--hierarchical-context-parallel-sizes",
                "2",
                "2",
            ][..],
        ),
        (
            "nccl-cp-p2p-sp",
            &[
                "--cp",
                "2",
                "--tp",
                "2",
                "--sequence-parallel",
                "--cp-comm-type",
                "p2p",
            ],
        ),
    ] {
        nccl_trains_as_threads(name, &[&common[..], flags].concat());
    }
}

/// The distributed optimizer over NCCL: two data-parallel pairs of tensor-parallel GPUs,
/// gradients reduce-scattered and parameters all-gathered by NCCL, bucket by bucket.
#[cfg(feature = "cuda")]
#[test]
#[ignore = "needs 4 GPUs and NCCL, or the emulated ones: MEGATRON_EMULATED_GPU=1"]
fn the_distributed_optimizer_with_nccl_under_mpirun_follows_thread_ranks_on_one_gpu() {
    if std::env::var_os("OMPI_COMM_WORLD_SIZE").is_some() {
        return;
    }
    // Each process writes its shard of the optimizer state at the end (over NCCL, the
    // writer's id is broadcast from a device tensor).
    let save = scratch_dir("nccl-distopt-save").join("ckpt");
    let args = [
        "--tp",
        "2",
        "--dp",
        "2",
        "--use-distributed-optimizer",
        "--ddp-bucket-size",
        "100000",
        "--train-iters",
        "3",
        "--global-batch-size",
        "8",
        "--seq-length",
        "64",
        "--device",
        "cuda",
        "--save",
        save.to_str().expect("a UTF-8 path"),
    ];
    nccl_trains_as_threads("nccl-distopt", &args);
    // 16-bit parameters: the all-gather moves bf16 or fp16 values over NCCL, and with fp16
    // the reduce-scatter fp16 gradients (scaled; the first steps overflow and are skipped).
    for (name, precision) in [
        ("nccl-distopt-bf16", &["--bf16"][..]),
        (
            "nccl-distopt-fp16",
            &["--fp16", "--initial-loss-scale", "1048576"],
        ),
    ] {
        let with = [&args[..], precision].concat();
        nccl_trains_as_threads(name, &with);
    }
}

/// A MoE GPT with its experts over two of four GPU processes (ep 2, edp 2) over NCCL: the
/// dispatcher's uneven all-to-alls as grouped NCCL sends and receives between the processes,
/// the experts' gradients reduced over the expert data-parallel pairs, against the same run of
/// thread ranks sharing one GPU. The router runs on each GPU, the experts on the host.
#[cfg(feature = "cuda")]
#[test]
#[ignore = "needs 4 GPUs and NCCL, or the emulated ones: MEGATRON_EMULATED_GPU=1"]
fn moe_training_with_nccl_under_mpirun_follows_thread_ranks_on_one_gpu() {
    if std::env::var_os("OMPI_COMM_WORLD_SIZE").is_some() {
        return;
    }
    let args = [
        "--model",
        "gpt-moe-tiny",
        "--num-layers",
        "2",
        "--dp",
        "4",
        "--ep",
        "2",
        "--moe-expert-capacity-factor",
        "1.5",
        "--train-iters",
        "3",
        "--micro-batch-size",
        "2",
        "--global-batch-size",
        "16",
        "--seq-length",
        "32",
        "--device",
        "cuda",
    ];
    nccl_trains_as_threads("nccl-moe", &args);
    let allgather = [&args[..], &["--moe-token-dispatcher-type", "allgather"]].concat();
    nccl_trains_as_threads("nccl-moe-allgather", &allgather);
}

/// DeepSeek-V3's blocks over NCCL with a depth of multi-token prediction: two pipeline stages
/// of two data-parallel GPUs, the experts over ep 2, the depth on the last stage looking up the
/// untied input table the first stage holds too (its gradient all-reduced between the stages'
/// GPUs), against the same run of thread ranks sharing one GPU.
#[cfg(feature = "cuda")]
#[test]
#[ignore = "needs 4 GPUs and NCCL, or the emulated ones: MEGATRON_EMULATED_GPU=1"]
fn deepseek_with_multi_token_prediction_over_nccl_follows_thread_ranks_on_one_gpu() {
    if std::env::var_os("OMPI_COMM_WORLD_SIZE").is_some() {
        return;
    }
    let args = [
        "--model",
        "deepseek-v3-tiny",
        "--mtp-num-layers",
        "1",
        "--pp",
        "2",
        "--dp",
        "2",
        "--ep",
        "2",
        "--train-iters",
        "2",
        "--micro-batch-size",
        "2",
        "--global-batch-size",
        "8",
        "--seq-length",
        "32",
        "--device",
        "cuda",
    ];
    nccl_trains_as_threads("nccl-deepseek-mtp", &args);
}

/// A pipeline of two stages (1F1B), each of two tensor-parallel GPUs, over NCCL: activations
/// and gradients between the stages' processes (each step's sends and receives in one NCCL
/// group), against the same pipeline of thread ranks sharing one GPU.
#[cfg(feature = "cuda")]
#[test]
#[ignore = "needs 4 GPUs and NCCL, or the emulated ones: MEGATRON_EMULATED_GPU=1"]
fn a_pipeline_with_nccl_under_mpirun_follows_thread_ranks_on_one_gpu() {
    if std::env::var_os("OMPI_COMM_WORLD_SIZE").is_some() {
        return;
    }
    // The end's checkpoint gathers the second stage's tensors to rank 0 over NCCL too.
    let save = scratch_dir("nccl-pipeline-save").join("ckpt");
    let args = [
        "--tp",
        "2",
        "--pp",
        "2",
        "--num-layers",
        "4",
        "--train-iters",
        "3",
        "--global-batch-size",
        "8",
        "--micro-batch-size",
        "2",
        "--seq-length",
        "64",
        "--device",
        "cuda",
        "--save",
        save.to_str().expect("a UTF-8 path"),
    ];
    nccl_trains_as_threads("nccl-pipeline", &args);
}

/// The interleaved schedule over NCCL: four stages of two chunks each (the last stage's
/// activations going back to the first), against the same pipeline of thread ranks. The
/// messages (128 KiB) are larger than what the emulated NCCL buffers, so a send waits for its
/// receive as NCCL's does.
#[cfg(feature = "cuda")]
#[test]
#[ignore = "needs 4 GPUs and NCCL, or the emulated ones: MEGATRON_EMULATED_GPU=1"]
fn an_interleaved_pipeline_with_nccl_under_mpirun_follows_thread_ranks_on_one_gpu() {
    if std::env::var_os("OMPI_COMM_WORLD_SIZE").is_some() {
        return;
    }
    let args = [
        "--pp",
        "4",
        "--vpp",
        "2",
        "--num-layers",
        "8",
        "--train-iters",
        "3",
        "--global-batch-size",
        "16",
        "--micro-batch-size",
        "2",
        "--seq-length",
        "128",
        "--device",
        "cuda",
    ];
    nccl_trains_as_threads("nccl-interleaved", &args);
}

/// The zero-bubble schedules over NCCL, one process per GPU: ZB-H1 over four stages and ZB-V
/// over four ranks of two chunks each (its exchanges batched for NCCL's rendezvous, the V's
/// turn a hand-over on the last rank), against the same pipelines of thread ranks sharing one
/// GPU.
#[cfg(feature = "cuda")]
#[test]
#[ignore = "needs 4 GPUs and NCCL, or the emulated ones: MEGATRON_EMULATED_GPU=1"]
fn zero_bubble_pipelines_with_nccl_under_mpirun_follow_thread_ranks_on_one_gpu() {
    if std::env::var_os("OMPI_COMM_WORLD_SIZE").is_some() {
        return;
    }
    for schedule in ["zb-h1", "zbv"] {
        let args = [
            "--pp",
            "4",
            "--pipeline-schedule",
            schedule,
            "--num-layers",
            "8",
            "--train-iters",
            "3",
            "--global-batch-size",
            "16",
            "--micro-batch-size",
            "2",
            "--seq-length",
            "128",
            "--device",
            "cuda",
        ];
        nccl_trains_as_threads(&format!("nccl-{schedule}"), &args);
    }
}

/// `--cuda-graph-scope attn mlp` with tensor parallelism over NCCL, one process per GPU: the
/// row-parallel layers' all-reduces (with sequence parallelism the all-gathers and
/// reduce-scatters of the shards) are recorded in the graphs and run at each replay (the
/// members replay in the same order), and the two processes give the eager run's losses and
/// gradient norms bit for bit.
#[cfg(feature = "cuda")]
#[test]
#[ignore = "needs 2 GPUs and NCCL, or the emulated ones: MEGATRON_EMULATED_GPU=1"]
fn graph_scopes_with_tensor_parallelism_over_nccl_replay_the_eager_run() {
    if std::env::var_os("OMPI_COMM_WORLD_SIZE").is_some() {
        return;
    }
    let args = [
        "--tp",
        "2",
        "--train-iters",
        "4",
        "--global-batch-size",
        "8",
        "--seq-length",
        "64",
        "--device",
        "cuda",
        "--backend",
        "nccl",
        "--hidden-dropout",
        "0",
        "--attention-dropout",
        "0",
    ];
    let library_path = gpu_library_path();
    let env = [("LD_LIBRARY_PATH", library_path.as_str())];
    let dir = scratch_dir("nccl-graphs");
    for sequence_parallel in [&[][..], &["--sequence-parallel"]] {
        let run = |name: &str, extra: &[&str]| -> Vec<serde_json::Value> {
            let mpi = megatron_under_mpirun(2, &env);
            train_log(
                mpi,
                &dir.join(name),
                &[&args[..], sequence_parallel, extra].concat(),
            )
            .iter()
            .map(|l| serde_json::from_str(l).expect("JSON line"))
            .collect()
        };
        let eager = run("eager.jsonl", &[]);
        let mut graphed = run("graphs.jsonl", &["--cuda-graph-scope", "attn", "mlp"]);
        let last = graphed.last().expect("a step")["graphs"].clone();
        assert!(last["captured"].as_u64() > Some(0), "{last}");
        assert!(last["replays"].as_u64() > Some(0), "{last}");
        for line in &mut graphed {
            line.as_object_mut().expect("object").remove("graphs");
        }
        assert_eq!(graphed, eager, "{sequence_parallel:?}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// `LD_LIBRARY_PATH` with the emulated GPU's libraries first when it is requested.
#[cfg(feature = "cuda")]
fn gpu_library_path() -> String {
    let library_path = std::env::var("LD_LIBRARY_PATH").unwrap_or_default();
    if device::requested() {
        let core = Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/megatron-core"));
        return format!("{}:{library_path}", device::build(core).display());
    }
    library_path
}

/// `megatron` under `mpirun -np np`, with `env` set and passed on to the processes.
fn megatron_under_mpirun(np: usize, env: &[(&str, &str)]) -> Command {
    let mut mpi = mpirun(np);
    for &(key, value) in env {
        mpi.env(key, value).args(["-x", key]);
    }
    mpi.arg(env!("CARGO_BIN_EXE_megatron"));
    mpi
}

/// [`processes_train_as_threads`] on the GPUs over NCCL, the CUDA libraries on the path.
#[cfg(feature = "cuda")]
fn nccl_trains_as_threads(name: &str, args: &[&str]) {
    let library_path = gpu_library_path();
    processes_train_as_threads(name, args, "nccl", &[("LD_LIBRARY_PATH", &library_path)]);
}

/// Runs `megatron train` with `args` as four thread ranks, then as four processes under
/// `mpirun` with `--backend <backend>` (`env` set for both, and passed on by mpirun), and
/// asserts that the two step logs are the same.
fn processes_train_as_threads(name: &str, args: &[&str], backend: &str, env: &[(&str, &str)]) {
    let dir = scratch_dir(name);
    let mut threads = Command::new(env!("CARGO_BIN_EXE_megatron"));
    threads.envs(env.iter().copied());
    let mpi = megatron_under_mpirun(4, env);
    // Both runs save into the same directory (the processes' checkpoint last): the second
    // replaces the first's iterations, as it is told to.
    let replace: &[&str] = if args.contains(&"--save") {
        &["--overwrite-checkpoints"]
    } else {
        &[]
    };
    let args = &[args, replace].concat();
    let on_threads = train_log(threads, &dir.join("threads.jsonl"), args);
    let with_backend = [&args[..], &["--backend", backend]].concat();
    let processes = train_log(mpi, &dir.join(format!("{backend}.jsonl")), &with_backend);
    assert_eq!(processes, on_threads);
    let _ = std::fs::remove_dir_all(&dir);
}

/// `--overlap-grad-reduce` and `--overlap-param-gather` over NCCL between processes (emulated
/// GPUs: each bucket's reduction where its last gradient is written, bf16 copies converted per
/// bucket) follows thread ranks on one GPU.
#[cfg(feature = "cuda")]
#[test]
#[ignore = "needs 4 GPUs and NCCL, or the emulated ones: MEGATRON_EMULATED_GPU=1"]
fn overlapped_reduction_with_nccl_follows_thread_ranks() {
    if std::env::var_os("OMPI_COMM_WORLD_SIZE").is_some() {
        return;
    }
    let args = [
        "--dp",
        "4",
        "--use-distributed-optimizer",
        "--overlap-grad-reduce",
        "--overlap-param-gather",
        "--ddp-bucket-size",
        "20000",
        "--train-iters",
        "3",
        "--global-batch-size",
        "16",
        "--seq-length",
        "64",
        "--device",
        "cuda",
    ];
    nccl_trains_as_threads("nccl-overlap", &args);
    // Sharded gradients: each bucket's device storage freed after each micro-batch's
    // reduce-scatter (on the rank's stream, after the communication stream's event) and
    // allocated again, zeroed, by the next write.
    let sharded = [
        "--dp",
        "4",
        "--data-parallel-sharding-strategy",
        "optim_grads",
        "--overlap-grad-reduce",
        "--overlap-param-gather",
        "--ddp-bucket-size",
        "20000",
        "--train-iters",
        "3",
        "--global-batch-size",
        "16",
        "--micro-batch-size",
        "2",
        "--seq-length",
        "64",
        "--device",
        "cuda",
    ];
    nccl_trains_as_threads("nccl-sharded-grads", &sharded);
    // Sharded parameters: each unit's device storages allocated for its gather (the next
    // unit's on the communication stream) and freed after its pass.
    let params = sharded.map(|a| {
        if a == "optim_grads" {
            "optim_grads_params"
        } else {
            a
        }
    });
    nccl_trains_as_threads("nccl-sharded-params", &params);
}

/// `megatron bench` under `mpirun` runs the job on the launch's ranks (it used to run the whole
/// job as thread ranks in every process) and only rank 0 reports.
#[test]
fn bench_under_mpirun_runs_on_the_processes_and_reports_once() {
    if std::env::var_os("OMPI_COMM_WORLD_SIZE").is_some() {
        return;
    }
    let mut cmd = mpirun(2);
    cmd.arg(env!("CARGO_BIN_EXE_megatron")).args([
        "bench",
        "--model",
        "gpt-tiny",
        "--backend",
        "mpi",
        "--tp",
        "2",
        "--train-iters",
        "2",
        "--warmup",
        "1",
        "--seq-length",
        "64",
        "--quiet",
    ]);
    let out = output_of(cmd);
    let all = text(&out);
    assert!(out.status.success(), "{all}");
    let report: serde_json::Value = serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("one JSON report ({e}): {all}"));
    assert_eq!(report["tp"], 2, "{all}");
    assert_eq!(report["timed_steps"], 2, "{all}");
    assert!(
        report["tokens_per_s"].as_f64().is_some_and(|t| t > 0.0),
        "{all}"
    );
}

#[test]
fn a_bad_flag_under_mpirun_fails_fast_with_its_message() {
    if std::env::var_os("OMPI_COMM_WORLD_SIZE").is_some() {
        return;
    }
    let exe = env!("CARGO_BIN_EXE_megatron");
    let started = Instant::now();
    let train = [
        exe,
        "train",
        "--backend",
        "mpi",
        "--model",
        "gpt-tiny",
        "--tp",
        "2",
        "--dp",
        "2",
    ];
    let mut cmd = mpirun(4);
    cmd.args(train).args(["--load", "/nonexistent/checkpoint"]);
    let out = output_of(cmd);
    let all = text(&out);
    assert!(!out.status.success(), "{all}");
    assert!(
        all.contains("/nonexistent/checkpoint: not a checkpoint"),
        "{all}"
    );
    assert!(started.elapsed() < Duration::from_secs(60), "{all}");

    // Too few processes for TP × DP.
    let mut cmd = mpirun(3);
    cmd.args(train);
    let out = output_of(cmd);
    let all = text(&out);
    assert!(!out.status.success(), "{all}");
    assert!(all.contains("needs 4 ranks, the world has 3"), "{all}");

    // A step that fails on every rank at once: each process's error is one whole line (they
    // share the terminal; a line written in parts interleaved with the others').
    let mut cmd = mpirun(4);
    cmd.args(train).args([
        "--num-layers",
        "1",
        "--seq-length",
        "16",
        "--train-iters",
        "2",
        "--init-method-std",
        "1e30",
    ]);
    let out = output_of(cmd);
    let all = text(&out);
    assert!(!out.status.success(), "{all}");
    let errors: Vec<&str> = all.lines().filter(|l| l.contains("error")).collect();
    assert!(!errors.is_empty(), "{all}");
    for line in errors.iter().filter(|l| l.contains("error: rank")) {
        assert!(
            line.starts_with("error: rank ") && line.contains(" of 4: step 0: the loss is "),
            "{all}"
        );
    }
}
