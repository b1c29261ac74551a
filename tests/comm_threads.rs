//! The in-process communicator: every collective against a direct computation, for several
//! group sizes and dtypes; determinism; mismatch, timeout and failing-rank behaviour; counters.

use std::time::Duration;

use half::bf16;
use megatron::comm::threads::{LaunchError, LaunchOptions, launch, launch_with};
use megatron::comm::{CommError, Communicator, OpKind, ParallelState, ReduceOp, World};
use megatron::parallel::{GroupKind, ParallelConfig, ParallelLayout};
use megatron::tensor::{DType, Tensor};

type R<T> = Result<T, Box<dyn std::error::Error + Send + Sync>>;

/// A deterministic value for (rank, element): distinct, not round, positive and negative.
fn value(rank: usize, i: usize) -> f32 {
    let x = (rank * 7919 + i * 104_729) % 1000;
    (x as f32 - 500.0) / 64.0 + 0.001 * i as f32
}

fn world_comm(world: &impl World) -> std::sync::Arc<dyn Communicator> {
    let ranks: Vec<usize> = (0..world.size()).collect();
    world.communicator("world", &ranks).expect("world group")
}

fn short_timeout() -> LaunchOptions {
    LaunchOptions::default().with_timeout(Duration::from_millis(300))
}

#[test]
fn all_reduce_sum_max_min_f32() {
    for n in [1, 2, 3, 4, 8] {
        let len = 10_000;
        for op in [ReduceOp::Sum, ReduceOp::Max, ReduceOp::Min] {
            let out = launch(n, |w| -> R<Vec<f32>> {
                let c = world_comm(&w);
                let t = Tensor::from_vec(
                    (0..len).map(|i| value(w.rank(), i)).collect::<Vec<_>>(),
                    [len],
                )?;
                c.all_reduce(&t, op)?;
                Ok(t.to_vec()?)
            })
            .unwrap();
            for i in 0..len {
                let vals = (0..n).map(|r| value(r, i));
                let expected = match op {
                    ReduceOp::Sum => (0..n).fold(0.0f32, |acc, r| {
                        if r == 0 {
                            value(0, i)
                        } else {
                            acc + value(r, i)
                        }
                    }),
                    ReduceOp::Max => vals.fold(f32::MIN, f32::max),
                    ReduceOp::Min => vals.fold(f32::MAX, f32::min),
                };
                for (r, o) in out.iter().enumerate() {
                    assert_eq!(
                        o[i].to_bits(),
                        expected.to_bits(),
                        "n {n} {op:?} rank {r} element {i}"
                    );
                }
            }
        }
    }
}

#[test]
fn all_reduce_bf16_accumulates_in_f32_and_rounds_once() {
    let n = 4;
    let len = 257;
    let out = launch(n, |w| -> R<Vec<bf16>> {
        let c = world_comm(&w);
        let data: Vec<bf16> = (0..len)
            .map(|i| bf16::from_f32(value(w.rank(), i)))
            .collect();
        let t = Tensor::from_vec(data, [len])?;
        c.all_reduce(&t, ReduceOp::Sum)?;
        Ok(t.to_vec()?)
    })
    .unwrap();
    for i in 0..len {
        let sum: f32 = (0..n).map(|r| bf16::from_f32(value(r, i)).to_f32()).sum();
        assert_eq!(out[0][i], bf16::from_f32(sum), "element {i}");
        assert!(out.iter().all(|o| o[i] == out[0][i]));
    }
}

#[test]
fn all_reduce_i64_is_exact() {
    let out = launch(3, |w| -> R<Vec<i64>> {
        let c = world_comm(&w);
        let t = Tensor::from_vec(vec![1i64 << 40, w.rank() as i64, -(w.rank() as i64)], [3])?;
        c.all_reduce(&t, ReduceOp::Sum)?;
        let m = Tensor::from_vec(vec![w.rank() as i64 * 10], [1])?;
        c.all_reduce(&m, ReduceOp::Max)?;
        let mut v = t.to_vec::<i64>()?;
        v.extend(m.to_vec::<i64>()?);
        Ok(v)
    })
    .unwrap();
    assert_eq!(out[1], vec![3 << 40, 3, -3, 20]);
}

#[test]
fn results_are_bit_identical_whatever_the_worker_count() {
    let run = |workers: usize| {
        launch_with(
            5,
            &LaunchOptions::default().with_comm_workers(workers),
            |w| -> R<Vec<u32>> {
                let c = world_comm(&w);
                let t = Tensor::from_vec(
                    (0..5000)
                        .map(|i| value(w.rank(), i) * 1e-3)
                        .collect::<Vec<_>>(),
                    [5000],
                )?;
                c.all_reduce(&t, ReduceOp::Sum)?;
                Ok(t.to_vec::<f32>()?.into_iter().map(f32::to_bits).collect())
            },
        )
        .unwrap()
    };
    let reference = run(1);
    for workers in [2, 3, 5, 8] {
        assert_eq!(run(workers), reference, "{workers} workers");
    }
    assert_eq!(run(2), reference, "a second run");
}

#[test]
fn all_gather_out_of_place_and_in_place() {
    for n in [1, 2, 3, 4] {
        let len = 1000;
        let out = launch(n, |w| -> R<(Vec<f32>, Vec<f32>)> {
            let c = world_comm(&w);
            let input = Tensor::from_vec(
                (0..len).map(|i| value(w.rank(), i)).collect::<Vec<_>>(),
                [len],
            )?;
            let output = Tensor::zeros([n, len], DType::F32);
            c.all_gather(&input, &output)?;
            // In place: the input is this rank's slot of the output, as the distributed optimizer does.
            let buffer = Tensor::zeros([n * len], DType::F32);
            let slot = buffer.narrow(0, w.rank() * len, len)?;
            slot.copy_from(&input)?;
            c.all_gather(&slot, &buffer)?;
            Ok((output.to_vec()?, buffer.to_vec()?))
        })
        .unwrap();
        let expected: Vec<f32> = (0..n)
            .flat_map(|r| (0..len).map(move |i| value(r, i)))
            .collect();
        for (a, b) in out {
            assert_eq!(a, expected);
            assert_eq!(b, expected);
        }
    }
}

#[test]
fn reduce_scatter_out_of_place_and_in_place() {
    for n in [1, 2, 4] {
        let len = 333;
        let out = launch(n, |w| -> R<(Vec<f32>, Vec<f32>)> {
            let c = world_comm(&w);
            let data: Vec<f32> = (0..n * len).map(|i| value(w.rank(), i)).collect();
            let input = Tensor::from_vec(data.clone(), [n * len])?;
            let output = Tensor::zeros([len], DType::F32);
            c.reduce_scatter(&input, &output, ReduceOp::Sum)?;
            let buffer = Tensor::from_vec(data, [n * len])?;
            let shard = buffer.narrow(0, w.rank() * len, len)?;
            c.reduce_scatter(&buffer, &shard, ReduceOp::Sum)?;
            Ok((output.to_vec()?, shard.to_vec()?))
        })
        .unwrap();
        for (r, (a, b)) in out.into_iter().enumerate() {
            let expected: Vec<f32> = (0..len)
                .map(|i| (1..n).fold(value(0, r * len + i), |acc, j| acc + value(j, r * len + i)))
                .collect();
            assert_eq!(a, expected, "rank {r}");
            assert_eq!(b, expected, "rank {r} in place");
        }
    }
}

#[test]
fn broadcast_from_every_root() {
    let n = 4;
    for root in 0..n {
        let out = launch(n, |w| -> R<Vec<f32>> {
            let c = world_comm(&w);
            let t = Tensor::from_vec(
                (0..100).map(|i| value(w.rank(), i)).collect::<Vec<_>>(),
                [100],
            )?;
            c.broadcast(&t, root)?;
            Ok(t.to_vec()?)
        })
        .unwrap();
        let expected: Vec<f32> = (0..100).map(|i| value(root, i)).collect();
        assert!(out.iter().all(|o| *o == expected), "root {root}");
    }
}

#[test]
fn all_to_all_with_uneven_splits() {
    let n = 4;
    // Rank i sends (i + j) % 3 elements to rank j (zeros included), valued 1000·i + 10·j + k.
    let splits = |i: usize, j: usize| (i + j) % 3;
    let out = launch(n, |w| -> R<Vec<f32>> {
        let c = world_comm(&w);
        let i = w.rank();
        let send: Vec<usize> = (0..n).map(|j| splits(i, j)).collect();
        let recv: Vec<usize> = (0..n).map(|j| splits(j, i)).collect();
        let data: Vec<f32> = (0..n)
            .flat_map(|j| (0..splits(i, j)).map(move |k| (1000 * i + 10 * j + k) as f32))
            .collect();
        let input = Tensor::from_vec(data, [send.iter().sum::<usize>()])?;
        let output = Tensor::zeros([recv.iter().sum::<usize>()], DType::F32);
        c.all_to_all(&input, &send, &output, &recv)?;
        Ok(output.to_vec()?)
    })
    .unwrap();
    for (j, o) in out.iter().enumerate() {
        let expected: Vec<f32> = (0..n)
            .flat_map(|i| (0..splits(i, j)).map(move |k| (1000 * i + 10 * j + k) as f32))
            .collect();
        assert_eq!(*o, expected, "rank {j}");
    }
}

#[test]
fn send_recv_in_order_and_both_directions() {
    let out = launch(3, |w| -> R<Vec<f32>> {
        let c = world_comm(&w);
        let r = w.rank();
        let mut got = Vec::new();
        // A ring: send twice to the next rank, then receive twice from the previous one.
        let next = (r + 1) % 3;
        let prev = (r + 2) % 3;
        for k in 0..2 {
            c.send(&Tensor::from_vec(vec![(10 * r + k) as f32; 4], [4])?, next)?;
        }
        for _ in 0..2 {
            let t = Tensor::zeros([4], DType::F32);
            c.recv(&t, prev)?;
            got.push(t.to_vec::<f32>()?[0]);
        }
        Ok(got)
    })
    .unwrap();
    assert_eq!(
        out,
        vec![vec![20.0, 21.0], vec![0.0, 1.0], vec![10.0, 11.0]]
    );
}

#[test]
fn an_owned_exchange_hands_a_sole_tensor_over_and_copies_a_shared_one() {
    // Rank 0 sends two tensors to rank 1: one nothing else holds (handed over: rank 1 gets the
    // same storage), and one whose storage rank 0 keeps a view of (copied: rank 0's view stays
    // its own). Mixed with an ordinary send after them, in order.
    let out = launch(2, |w| -> R<(Vec<f32>, bool, bool)> {
        let c = world_comm(&w);
        let address = |t: &Tensor| t.read::<f32>().map(|v| v.as_ptr() as usize).unwrap_or(0);
        match w.rank() {
            0 => {
                let sole = Tensor::from_vec(vec![1.0f32, 2.0, 3.0, 4.0], [2, 2])?;
                let kept = Tensor::from_vec(vec![5.0f32; 4], [4])?;
                let shared = kept.clone();
                let (sole_at, shared_at) = (address(&sole), address(&kept));
                c.exchange_owned(vec![(sole, 1), (shared, 1)], Vec::new())?;
                c.send(&Tensor::from_vec(vec![9.0f32; 4], [4])?, 1)?;
                // Rank 1 reports which storages it got; rank 0 tells it these.
                let at = Tensor::from_vec(vec![sole_at as i64, shared_at as i64], [2])?;
                c.send(&at, 1)?;
                // `kept` lives until rank 1 has compared: its memory, freed, could be the next
                // allocation of the same size (a receive buffer is allocated when first written).
                c.barrier()?;
                Ok((kept.to_vec::<f32>()?, true, true))
            }
            _ => {
                let buffers = vec![
                    (Tensor::zeros([2, 2], DType::F32), 0),
                    (Tensor::zeros([4], DType::F32), 0),
                ];
                let got = c.exchange_owned(Vec::new(), buffers)?;
                let last = Tensor::zeros([4], DType::F32);
                c.recv(&last, 0)?;
                let at = Tensor::zeros([2], DType::I64);
                c.recv(&at, 0)?;
                let at = at.to_vec::<i64>()?;
                let mut values = got[0].to_vec::<f32>()?;
                values.extend(got[1].to_vec::<f32>()?);
                values.extend(last.to_vec::<f32>()?);
                assert_eq!(got[0].dims(), [2, 2]);
                let moved = (
                    address(&got[0]) as i64 == at[0],
                    address(&got[1]) as i64 == at[1],
                );
                c.barrier()?;
                Ok((values, moved.0, moved.1))
            }
        }
    })
    .unwrap();
    assert_eq!(
        out[0].0,
        vec![5.0; 4],
        "the sender's kept view is untouched"
    );
    let (values, sole_moved, shared_moved) = &out[1];
    assert_eq!(
        values,
        &[1.0, 2.0, 3.0, 4.0, 5.0, 5.0, 5.0, 5.0, 9.0, 9.0, 9.0, 9.0]
    );
    assert!(
        sole_moved,
        "a tensor nothing else holds goes without a copy"
    );
    assert!(!shared_moved, "a tensor the sender still views is copied");
}

#[test]
fn barrier_and_groups_of_a_parallel_layout() {
    let layout = ParallelLayout::new(&ParallelConfig::new(8).with_tp(2).with_pp(2)).unwrap();
    let out = launch(8, |w| -> R<(f32, f32, usize)> {
        let ps = ParallelState::new(&w, &layout)?;
        ps.comm(GroupKind::World).barrier()?;
        let t = Tensor::from_vec(vec![w.rank() as f32], [1])?;
        ps.tp().all_reduce(&t, ReduceOp::Sum)?;
        let d = Tensor::from_vec(vec![w.rank() as f32], [1])?;
        ps.dp().all_reduce(&d, ReduceOp::Sum)?;
        Ok((
            t.to_vec::<f32>()?[0],
            d.to_vec::<f32>()?[0],
            ps.groups().pp_rank(),
        ))
    })
    .unwrap();
    // tp groups [0,1] [2,3] ...; dp groups [0,2] [1,3] [4,6] [5,7]; pp stage = rank / 4.
    assert_eq!(out[0], (1.0, 2.0, 0));
    assert_eq!(out[3], (5.0, 4.0, 0));
    assert_eq!(out[6], (13.0, 10.0, 1));
}

/// Runs `f` on every rank of an n-rank world and returns what each rank's last call said.
fn errors_of(
    n: usize,
    options: LaunchOptions,
    f: impl Fn(usize, &dyn Communicator) -> Result<(), CommError> + Sync,
) -> Vec<String> {
    launch_with(n, &options, |w| -> R<String> {
        let c = world_comm(&w);
        Ok(match f(w.rank(), c.as_ref()) {
            Ok(()) => "ok".to_string(),
            Err(e) => e.to_string(),
        })
    })
    .unwrap()
}

#[test]
fn different_collectives_are_an_error_naming_both_calls() {
    let errs = errors_of(3, short_timeout(), |rank, c| {
        let t = Tensor::zeros([16], DType::F32);
        if rank == 2 {
            c.broadcast(&t, 0)
        } else {
            c.all_reduce(&t, ReduceOp::Sum)
        }
    });
    for e in &errs {
        assert_eq!(
            e,
            "collective mismatch in group world: rank 0 called all_reduce(sum, f32 × 16), rank 2 called broadcast(root 0, f32 × 16)"
        );
    }
}

#[test]
fn different_sizes_and_dtypes_are_errors() {
    let errs = errors_of(2, short_timeout(), |rank, c| {
        c.all_reduce(&Tensor::zeros([8 + rank], DType::F32), ReduceOp::Sum)
    });
    assert!(
        errs.iter().all(|e| e.contains(
            "rank 0 called all_reduce(sum, f32 × 8), rank 1 called all_reduce(sum, f32 × 9)"
        )),
        "{errs:?}"
    );
    let errs = errors_of(2, short_timeout(), |rank, c| {
        let dtype = if rank == 0 { DType::F32 } else { DType::BF16 };
        c.all_reduce(&Tensor::zeros([8], dtype), ReduceOp::Sum)
    });
    assert!(errs.iter().all(|e| e.contains("bf16 × 8")), "{errs:?}");
    // A mismatched group stays failed: the next call reports the same error instead of hanging.
    let errs = errors_of(2, short_timeout(), |rank, c| {
        let _ = c.all_reduce(
            &Tensor::zeros([8], DType::F32),
            if rank == 0 {
                ReduceOp::Sum
            } else {
                ReduceOp::Max
            },
        );
        c.barrier()
    });
    assert!(
        errs.iter()
            .all(|e| e.contains("rank 1 called all_reduce(max")),
        "{errs:?}"
    );
    let errs = errors_of(2, short_timeout(), |rank, c| {
        let send = [1, 1];
        let recv = if rank == 0 { [1, 1] } else { [2, 0] };
        let out = Tensor::zeros([2], DType::F32);
        c.all_to_all(&Tensor::zeros([2], DType::F32), &send, &out, &recv)
    });
    assert!(
        errs.iter()
            .all(|e| e.contains("sending 1 elements to rank 1")
                && e.contains("expecting 2 elements from rank 0")),
        "{errs:?}"
    );
}

#[test]
fn send_recv_size_mismatch_is_an_error() {
    let errs = errors_of(2, short_timeout(), |rank, c| {
        if rank == 0 {
            c.send(&Tensor::zeros([5], DType::F32), 1)
        } else {
            c.recv(&Tensor::zeros([6], DType::F32), 0)
        }
    });
    assert_eq!(errs[0], "ok");
    assert_eq!(
        errs[1],
        "collective mismatch in group world: rank 0 called send(to 1, f32 × 5), rank 1 called recv(from 0, f32 × 6)"
    );
}

#[test]
fn a_rank_that_never_arrives_is_a_timeout_naming_it() {
    let errs = errors_of(4, short_timeout(), |rank, c| {
        if rank == 3 {
            Ok(())
        } else {
            c.all_reduce(&Tensor::zeros([4], DType::F32), ReduceOp::Sum)
        }
    });
    for e in &errs[..3] {
        assert!(e.starts_with("timeout after 300ms in group world waiting for all_reduce(sum, f32 × 4): global ranks [3] never arrived"), "{e}");
    }
    let errs = errors_of(2, short_timeout(), |rank, c| {
        if rank == 0 {
            c.recv(&Tensor::zeros([1], DType::F32), 1)
        } else {
            Ok(())
        }
    });
    assert!(
        errs[0].contains("global ranks [1] never arrived"),
        "{}",
        errs[0]
    );
}

#[test]
fn a_failing_rank_stops_every_rank_with_its_error() {
    // Long timeout: the others must be woken by the failure, not by the timeout.
    let options = LaunchOptions::default().with_timeout(Duration::from_secs(600));
    let seen = std::sync::Mutex::new(Vec::new());
    let err = launch_with(4, &options, |w| -> Result<(), String> {
        let c = world_comm(&w);
        if w.rank() == 2 {
            return Err("out of memory on purpose".into());
        }
        let r = c.all_reduce(&Tensor::zeros([4], DType::F32), ReduceOp::Sum);
        seen.lock()
            .unwrap()
            .push(format!("{:?}", r.as_ref().err().map(ToString::to_string)));
        r.map_err(|e| e.to_string())
    })
    .unwrap_err();
    match err {
        LaunchError::Rank {
            rank,
            message,
            panicked,
        } => {
            assert_eq!(
                (rank, message.as_str(), panicked),
                (2, "out of memory on purpose", false)
            );
        }
        other => panic!("{other}"),
    }
    let seen = seen.into_inner().unwrap();
    assert_eq!(seen.len(), 3);
    assert!(
        seen.iter()
            .all(|s| s.contains("rank 2 failed: out of memory on purpose")),
        "{seen:?}"
    );
}

#[test]
fn a_panicking_rank_stops_every_rank() {
    let options = LaunchOptions::default().with_timeout(Duration::from_secs(600));
    let err = launch_with(3, &options, |w| -> Result<(), CommError> {
        let c = world_comm(&w);
        if w.rank() == 0 {
            c.barrier()?;
            panic!("kernel bug on purpose");
        }
        c.barrier()?;
        c.send(&Tensor::zeros([1], DType::F32), 0)?;
        c.recv(&Tensor::zeros([1], DType::F32), 0)
    })
    .unwrap_err();
    assert_eq!(err.to_string(), "rank 0 panicked: kernel bug on purpose");
}

#[test]
fn invalid_arguments_are_clear_errors() {
    let errs = errors_of(2, short_timeout(), |rank, c| {
        if rank == 0 {
            let e1 = c
                .broadcast(&Tensor::zeros([1], DType::F32), 5)
                .unwrap_err()
                .to_string();
            assert_eq!(
                e1,
                "group world: broadcast root 5 is outside the group of 2 ranks"
            );
            let e2 = c
                .all_gather(
                    &Tensor::zeros([3], DType::F32),
                    &Tensor::zeros([5], DType::F32),
                )
                .unwrap_err()
                .to_string();
            assert!(
                e2.contains("output has 5 elements, expected 2 ranks × 3 input elements"),
                "{e2}"
            );
            let e3 = c
                .all_to_all(
                    &Tensor::zeros([3], DType::F32),
                    &[1, 1],
                    &Tensor::zeros([2], DType::F32),
                    &[1, 1],
                )
                .unwrap_err()
                .to_string();
            assert!(
                e3.contains("send splits [1, 1] add up to 2, the buffer has 3 elements"),
                "{e3}"
            );
            let e4 = c
                .send(&Tensor::zeros([1], DType::F32), 0)
                .unwrap_err()
                .to_string();
            assert!(e4.contains("sends to itself"), "{e4}");
            let strided =
                Tensor::zeros([2, 2], DType::F32)
                    .t()
                    .map_err(|e| CommError::Invalid {
                        group: "t".into(),
                        message: e.to_string(),
                    })?;
            let e5 = c
                .all_reduce(&strided, ReduceOp::Sum)
                .unwrap_err()
                .to_string();
            assert!(e5.contains("not contiguous"), "{e5}");
        }
        Ok(())
    });
    assert_eq!(errs, vec!["ok", "ok"]);
}

#[test]
fn counters_record_calls_and_bytes_per_kind() {
    let stats = launch(2, |w| -> R<_> {
        let c = world_comm(&w);
        let before = c.stats();
        c.all_reduce(&Tensor::zeros([100], DType::F32), ReduceOp::Sum)?;
        c.all_reduce(&Tensor::zeros([10], DType::BF16), ReduceOp::Sum)?;
        c.all_gather(
            &Tensor::zeros([8], DType::F32),
            &Tensor::zeros([16], DType::F32),
        )?;
        c.reduce_scatter(
            &Tensor::zeros([16], DType::F32),
            &Tensor::zeros([8], DType::F32),
            ReduceOp::Sum,
        )?;
        if w.rank() == 0 {
            c.send(&Tensor::zeros([3], DType::I64), 1)?;
        } else {
            c.recv(&Tensor::zeros([3], DType::I64), 0)?;
        }
        c.barrier()?;
        Ok(c.stats().since(&before))
    })
    .unwrap();
    let s = &stats[0];
    assert_eq!(
        (
            s.get(OpKind::AllReduce).calls,
            s.get(OpKind::AllReduce).bytes
        ),
        (2, 420)
    );
    assert_eq!(
        (
            s.get(OpKind::AllGather).calls,
            s.get(OpKind::AllGather).bytes
        ),
        (1, 32)
    );
    assert_eq!(
        (
            s.get(OpKind::ReduceScatter).calls,
            s.get(OpKind::ReduceScatter).bytes
        ),
        (1, 32)
    );
    assert_eq!(
        (s.get(OpKind::Send).calls, s.get(OpKind::Send).bytes),
        (1, 24)
    );
    assert_eq!(s.get(OpKind::Recv).calls, 0);
    assert_eq!(stats[1].get(OpKind::Recv).bytes, 24);
    assert_eq!(s.get(OpKind::Barrier).calls, 1);
}

#[test]
fn launch_errors() {
    assert!(matches!(
        launch(0, |_| Ok::<(), CommError>(())),
        Err(LaunchError::EmptyWorld)
    ));
    let err = launch(2, |w| -> R<()> {
        w.communicator("tp", &[0, 5])?;
        Ok(())
    })
    .unwrap_err();
    assert!(
        err.to_string()
            .contains("rank 5 is outside the world of 2 ranks")
            || err.to_string().contains("is not a member"),
        "{err}"
    );
}

/// A started collective runs on the rank's progress thread while the rank goes on: rank 0
/// starts an all-reduce on group `a` and then meets rank 1 in a collective of group `b`, which
/// rank 1 calls first. Were the start to wait for the all-reduce, each rank would wait for the
/// other (a timeout); started, both complete.
#[test]
fn a_started_collective_runs_while_the_rank_goes_on() {
    let out = launch_with(2, &short_timeout(), |w| -> R<(Vec<f32>, Vec<f32>)> {
        let (a, b) = (w.communicator("a", &[0, 1])?, w.communicator("b", &[0, 1])?);
        let x = Tensor::from_vec(vec![w.rank() as f32 + 1.0; 4], [4])?;
        let y = Tensor::from_vec(vec![10.0 * (w.rank() as f32 + 1.0); 2], [2])?;
        if w.rank() == 0 {
            let pending = a.start_all_reduce(&x, ReduceOp::Sum)?;
            b.all_reduce(&y, ReduceOp::Sum)?;
            pending.wait()?;
        } else {
            b.all_reduce(&y, ReduceOp::Sum)?;
            a.all_reduce(&x, ReduceOp::Sum)?;
        }
        Ok((x.to_vec::<f32>()?, y.to_vec::<f32>()?))
    })
    .unwrap();
    for (x, y) in out {
        assert_eq!((x, y), (vec![3.0; 4], vec![30.0; 2]));
    }
}

/// Started and waited-for collectives of one group run in the order each rank calls them: an
/// all-reduce, an all-gather and a reduce-scatter started, a blocking broadcast among them,
/// give what the same calls give one after the other; the counters count them all.
#[test]
fn started_collectives_keep_the_ranks_order() {
    let n = 3;
    let out = launch(n, |w| -> R<(Vec<Vec<f32>>, u64)> {
        let c = world_comm(&w);
        let r = w.rank();
        let x = Tensor::from_vec((0..6).map(|i| value(r, i)).collect::<Vec<_>>(), [6])?;
        let part = Tensor::from_vec(vec![r as f32; 2], [2])?;
        let gathered = Tensor::zeros([2 * n], DType::F32);
        let whole = Tensor::from_vec((0..3 * n).map(|i| value(r, i)).collect::<Vec<_>>(), [3 * n])?;
        let slot = Tensor::zeros([3], DType::F32);
        let root = Tensor::from_vec(vec![r as f32; 3], [3])?;
        let first = c.start_all_reduce(&x, ReduceOp::Sum)?;
        let second = c.start_all_gather(&part, &gathered)?;
        c.broadcast(&root, 2)?;
        let third = c.start_reduce_scatter(&whole, &slot, ReduceOp::Max)?;
        // Waited for in another order than started: each is its own.
        third.wait()?;
        first.wait()?;
        second.wait()?;
        let calls = c.stats().ops.values().map(|s| s.calls).sum();
        Ok((
            vec![
                x.to_vec()?,
                gathered.to_vec()?,
                root.to_vec()?,
                slot.to_vec()?,
            ],
            calls,
        ))
    })
    .unwrap();
    let sum: Vec<f32> = (0..6)
        .map(|i| (0..n).map(|r| value(r, i)).fold(0.0, |a, v| a + v))
        .collect();
    for (r, (got, calls)) in out.iter().enumerate() {
        assert_eq!(got[0], sum, "rank {r}: all-reduce");
        assert_eq!(
            got[1],
            [0.0, 0.0, 1.0, 1.0, 2.0, 2.0],
            "rank {r}: all-gather"
        );
        assert_eq!(got[2], [2.0; 3], "rank {r}: broadcast");
        let max: Vec<f32> = (3 * r..3 * r + 3)
            .map(|i| (0..n).map(|q| value(q, i)).fold(f32::MIN, f32::max))
            .collect();
        assert_eq!(got[3], max, "rank {r}: reduce-scatter");
        assert_eq!(*calls, 4, "rank {r}");
    }
}

/// A started collective's error comes at its wait, naming the group and both calls; a rank
/// that fails wakes the others' started collectives with its error.
#[test]
fn a_started_collectives_errors_come_at_its_wait() {
    let errs = errors_of(2, short_timeout(), |rank, c| {
        let t = Tensor::zeros([4 + rank], DType::F32);
        c.start_all_reduce(&t, ReduceOp::Sum)?.wait()
    });
    for e in &errs {
        assert!(
            e.contains("collective mismatch in group world") && e.contains("all_reduce"),
            "{e}"
        );
    }
    let options = LaunchOptions::default().with_timeout(Duration::from_secs(600));
    let seen = std::sync::Mutex::new(Vec::new());
    let err = launch_with(3, &options, |w| -> Result<(), String> {
        let c = world_comm(&w);
        if w.rank() == 1 {
            return Err("a failure on purpose".into());
        }
        let t = Tensor::zeros([4], DType::F32);
        let pending = c
            .start_all_reduce(&t, ReduceOp::Sum)
            .map_err(|e| e.to_string())?;
        let r = pending.wait();
        seen.lock()
            .unwrap()
            .push(format!("{:?}", r.as_ref().err().map(ToString::to_string)));
        r.map_err(|e| e.to_string())
    })
    .unwrap_err();
    assert!(matches!(err, LaunchError::Rank { rank: 1, .. }), "{err}");
    let seen = seen.into_inner().unwrap();
    assert_eq!(seen.len(), 2);
    assert!(
        seen.iter()
            .all(|s| s.contains("rank 1 failed: a failure on purpose")),
        "{seen:?}"
    );
}
