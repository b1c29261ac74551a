use half::bf16;

use super::*;

fn arange(shape: impl Into<Shape>) -> Tensor {
    let shape = shape.into();
    Tensor::from_vec((0..shape.numel()).map(|i| i as f32).collect(), shape).unwrap()
}

#[test]
fn views_share_storage_and_copy_nothing() {
    let t = arange([2, 3]);
    let tt = t.t().unwrap();
    assert_eq!(tt.dims(), &[3, 2]);
    assert!(!tt.is_contiguous());
    assert!(tt.same_storage(&t));
    assert_eq!(tt.to_vec::<f32>().unwrap(), vec![0., 3., 1., 4., 2., 5.]);
    let col = t.narrow(1, 1, 2).unwrap();
    assert_eq!(col.to_vec::<f32>().unwrap(), vec![1., 2., 4., 5.]);
    assert_eq!(
        t.chunk(3, 2, 1).unwrap().to_vec::<f32>().unwrap(),
        vec![2., 5.]
    );
    let c = tt.contiguous().unwrap();
    assert!(c.is_contiguous() && !c.same_storage(&t));
    assert_eq!(c.to_vec::<f32>().unwrap(), vec![0., 3., 1., 4., 2., 5.]);
}

#[test]
fn writes_through_a_view_reach_the_storage() {
    let flat = Tensor::zeros([10], DType::F32);
    let param = flat.narrow(0, 4, 6).unwrap().reshape([2, 3]).unwrap();
    param
        .write::<f32>()
        .unwrap()
        .copy_from_slice(&[1., 2., 3., 4., 5., 6.]);
    assert_eq!(
        flat.to_vec::<f32>().unwrap(),
        vec![0., 0., 0., 0., 1., 2., 3., 4., 5., 6.]
    );
}

#[test]
fn conflicting_borrows_are_errors() {
    let t = arange([4]);
    let r = t.read::<f32>().unwrap();
    let err = t.write::<f32>().err().unwrap();
    assert!(matches!(err, TensorError::Borrowed { write: true, .. }));
    assert!(err.to_string().contains("alias"));
    drop(r);
    let _w = t.write::<f32>().unwrap();
    assert!(t.read::<f32>().is_err());
}

#[test]
fn dtype_conversion_rounds_once() {
    let t = Tensor::from_vec(vec![1.0f32, 1.0 + 1.0 / 256.0, -3.5], [3]).unwrap();
    let b = t.to_dtype(DType::BF16).unwrap();
    assert_eq!(b.dtype(), DType::BF16);
    assert_eq!(b.to_vec::<bf16>().unwrap()[2], bf16::from_f32(-3.5));
    assert_eq!(b.to_vec_f32().unwrap(), vec![1.0, 1.0, -3.5]);
    let ids = Tensor::from_vec(vec![3i64, 7], [2]).unwrap();
    assert_eq!(
        ids.to_dtype(DType::F32).unwrap().to_vec::<f32>().unwrap(),
        vec![3.0, 7.0]
    );
}

#[test]
fn bad_shapes_name_the_numbers() {
    let t = arange([2, 3]);
    let msg = t.narrow(1, 2, 2).unwrap_err().to_string();
    assert_eq!(
        msg,
        "narrow: range 2..4 of dimension 1 exceeds its size 3 (shape [2, 3])"
    );
    let msg = t.reshape([4, 2]).unwrap_err().to_string();
    assert!(
        msg.contains("cannot view 6 elements of shape [2, 3] as [4, 2]"),
        "{msg}"
    );
    assert!(t.t().unwrap().reshape([6]).is_err());
    assert!(Tensor::from_vec(vec![1.0f32; 5], [2, 3]).is_err());
    assert!(matches!(t.read::<i64>(), Err(TensorError::DType { .. })));
    assert!(t.chunk(4, 0, 1).is_err());
}

#[test]
fn copy_from_overlapping_view() {
    let t = arange([4]);
    let dst = t.narrow(0, 1, 3).unwrap();
    dst.copy_from(&t.narrow(0, 0, 3).unwrap()).unwrap();
    assert_eq!(t.to_vec::<f32>().unwrap(), vec![0., 0., 1., 2.]);
}

#[test]
fn copy_into_a_strided_view_writes_its_elements_only() {
    // Columns 1..3 of a 2×4 bf16 matrix from a transposed f32 source: converted, in order.
    let t = Tensor::zeros([2, 4], DType::BF16);
    let cols = t.narrow(1, 1, 2).unwrap();
    cols.copy_from(&arange([2, 2]).t().unwrap()).unwrap();
    assert_eq!(
        t.to_dtype(DType::F32).unwrap().to_vec::<f32>().unwrap(),
        vec![0., 0., 2., 0., 0., 1., 3., 0.]
    );
    assert!(cols.copy_from(&arange([2, 3])).is_err());
}

#[test]
fn disjoint_views_of_one_storage_are_written_at_once() {
    let flat = Tensor::zeros([10], DType::F32);
    let (a, b) = (flat.narrow(0, 0, 4).unwrap(), flat.narrow(0, 4, 6).unwrap());
    let mut wa = a.write::<f32>().unwrap();
    let mut wb = b.write::<f32>().unwrap();
    wa.fill(1.0);
    wb.fill(2.0);
    // Overlapping borrows conflict while held, and are free again once dropped.
    assert!(flat.read::<f32>().is_err());
    assert!(flat.narrow(0, 3, 2).unwrap().write::<f32>().is_err());
    drop((wa, wb));
    assert_eq!(
        flat.to_vec::<f32>().unwrap(),
        [1.0, 1.0, 1.0, 1.0, 2.0, 2.0, 2.0, 2.0, 2.0, 2.0]
    );
    // Shared reads of overlapping views coexist.
    let view = flat.narrow(0, 2, 3).unwrap();
    let r1 = flat.read::<f32>().unwrap();
    let r2 = view.read::<f32>().unwrap();
    assert_eq!(r1[2], r2[0]);
}

#[test]
fn an_evicted_storage_is_an_error_to_read_until_restored() {
    // A size no other test allocates, so that the pool hands nothing else this block.
    let n = 12_349;
    let t = Tensor::from_vec(vec![1.5f32; n], [n]).unwrap();
    let view = t.narrow(0, 10, 5).unwrap();
    let account = host_memory::this_thread();
    let before = account.live_bytes();
    {
        let _reading = view.read::<f32>().unwrap();
        assert!(!t.storage().evict());
    }
    assert!(t.storage().evict());
    assert!(!t.storage().is_resident());
    assert_eq!(before - account.live_bytes(), n * 4);
    // A read or a write through any view is an error naming the reason, and allocates nothing.
    let err = view.to_vec::<f32>().unwrap_err().to_string();
    assert!(err.contains("memory is given back"), "{err}");
    assert!(view.fill(2.0).is_err());
    assert!(!t.storage().is_resident());
    // Restored, it holds zeros until written (a gather fills it).
    t.storage().restore().unwrap();
    assert!(t.storage().is_resident());
    assert_eq!(account.live_bytes(), before);
    assert_eq!(view.to_vec::<f32>().unwrap(), vec![0.0; 5]);
}

#[test]
fn a_released_storage_frees_its_memory_and_reads_as_zeros_until_written_again() {
    // A size no other test allocates, so that the pool hands nothing else this block.
    let n = 12_347;
    let t = Tensor::from_vec(vec![1.5f32; n], [n]).unwrap();
    let view = t.narrow(0, 10, 5).unwrap();
    let account = host_memory::this_thread();
    let before = account.live_bytes();
    {
        // Not while something borrows it.
        let _reading = view.read::<f32>().unwrap();
        assert!(!t.storage().release());
        assert!(t.storage().is_resident());
    }
    assert!(t.storage().release());
    assert!(!t.storage().is_resident());
    assert_eq!(before - account.live_bytes(), n * 4);
    // The next borrow allocates it again, zeroed, through any view.
    assert_eq!(view.to_vec::<f32>().unwrap(), vec![0.0; 5]);
    assert!(t.storage().is_resident());
    assert_eq!(account.live_bytes(), before);
    view.fill(2.0).unwrap();
    let all = t.to_vec::<f32>().unwrap();
    assert_eq!(all.iter().sum::<f32>(), 10.0);
    assert_eq!(&all[10..15], &[2.0; 5]);
}
