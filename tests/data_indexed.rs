//! Megatron-LM's indexed dataset: files written to the format's specification byte by byte in
//! this test (independently of the library's writer) are read back; the library's writer makes
//! the same bytes; corrupt files are errors naming the file and what is wrong.

use std::path::{Path, PathBuf};

use megatron::data::{DType, DataError, IndexedDataset, IndexedDatasetBuilder};

struct TempDir(PathBuf);

impl TempDir {
    fn new(name: &str) -> TempDir {
        let dir = std::env::temp_dir().join(format!(
            "megatron-data-indexed-{name}-{}",
            std::process::id()
        ));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        TempDir(dir)
    }

    fn prefix(&self, name: &str) -> PathBuf {
        self.0.join(name)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn with(prefix: &Path, suffix: &str) -> PathBuf {
    PathBuf::from(format!("{}{suffix}", prefix.display()))
}

/// The `.idx` and `.bin` bytes of `docs` (each a list of sequences), following the format's
/// specification: magic, version 1, dtype code, sequence count, document-index length, then
/// i32 lengths, i64 byte offsets, i64 document index.
fn spec_bytes(code: u8, size: usize, docs: &[Vec<Vec<i64>>]) -> (Vec<u8>, Vec<u8>) {
    let mut bin = Vec::new();
    let mut lengths = Vec::new();
    let mut pointers = Vec::new();
    let mut doc_index = vec![0i64];
    for doc in docs {
        for seq in doc {
            pointers.push(bin.len() as i64);
            lengths.push(seq.len() as i32);
            for &t in seq {
                bin.extend_from_slice(&t.to_le_bytes()[..size]);
            }
        }
        doc_index.push(lengths.len() as i64);
    }
    let mut idx = b"MMIDIDX\x00\x00".to_vec();
    idx.extend_from_slice(&1u64.to_le_bytes());
    idx.push(code);
    idx.extend_from_slice(&(lengths.len() as u64).to_le_bytes());
    idx.extend_from_slice(&(doc_index.len() as u64).to_le_bytes());
    lengths
        .iter()
        .for_each(|l| idx.extend_from_slice(&l.to_le_bytes()));
    pointers
        .iter()
        .for_each(|p| idx.extend_from_slice(&p.to_le_bytes()));
    doc_index
        .iter()
        .for_each(|d| idx.extend_from_slice(&d.to_le_bytes()));
    (idx, bin)
}

fn write(prefix: &Path, (idx, bin): &(Vec<u8>, Vec<u8>)) {
    std::fs::write(with(prefix, ".idx"), idx).unwrap();
    std::fs::write(with(prefix, ".bin"), bin).unwrap();
}

fn sample_docs(max: i64) -> Vec<Vec<Vec<i64>>> {
    vec![
        vec![vec![1, 2, 3], vec![max, 0]],
        vec![],
        vec![vec![7]],
        vec![vec![], vec![5, 6, 7, 8, max - 1]],
    ]
}

#[test]
fn reads_a_dataset_written_to_the_specification_in_every_integer_type() {
    let dir = TempDir::new("spec");
    for (code, dtype, size, max) in [
        (1u8, DType::U8, 1usize, 255i64),
        (8, DType::U16, 2, 65_535),
        (4, DType::I32, 4, i64::from(i32::MAX)),
        (5, DType::I64, 8, 1 << 40),
    ] {
        let prefix = dir.prefix(dtype.name());
        let docs = sample_docs(max);
        write(&prefix, &spec_bytes(code, size, &docs));
        let ds = IndexedDataset::open(&prefix).unwrap();
        assert_eq!(ds.dtype(), dtype);
        assert_eq!(ds.len(), 5);
        assert_eq!(ds.documents(), 4);
        assert_eq!(ds.num_tokens(), 11);
        assert_eq!(ds.validate().unwrap(), 11);
        let flat: Vec<&Vec<i64>> = docs.iter().flatten().collect();
        for (i, seq) in flat.iter().enumerate() {
            assert_eq!(ds.sequence_length(i).unwrap(), seq.len());
            assert_eq!(
                &ds.sequence(i).unwrap().to_i64_vec(),
                *seq,
                "{dtype} sequence {i}"
            );
        }
        assert_eq!(ds.document_sequences(1).unwrap(), 2..2);
        assert_eq!(ds.document_sequences(3).unwrap(), 3..5);
        assert_eq!(ds.document(0).unwrap(), [1, 2, 3, max, 0]);
        assert_eq!(ds.document(1).unwrap(), Vec::<i64>::new());
        assert_eq!(ds.get(4, 1, Some(3)).unwrap().to_i64_vec(), [6, 7, 8]);
        assert_eq!(ds.get(4, 2, None).unwrap().to_i64_vec(), [7, 8, max - 1]);
        assert!(ds.get(4, 3, Some(3)).is_err());
        assert!(ds.sequence(5).is_err());
        if max <= i64::from(u32::MAX) {
            assert_eq!(
                ds.sequence(1).unwrap().to_u32_vec().unwrap(),
                [max as u32, 0]
            );
        } else {
            let err = ds.sequence(1).unwrap().to_u32_vec().unwrap_err();
            assert!(err.to_string().contains("does not fit"), "{err}");
        }
    }
}

#[test]
fn the_writer_makes_the_specifications_bytes() {
    let dir = TempDir::new("writer");
    for (code, dtype, size) in [(8u8, DType::U16, 2usize), (4, DType::I32, 4)] {
        let docs = sample_docs(60_000);
        let expected = spec_bytes(code, size, &docs);
        let prefix = dir.prefix(dtype.name());
        let mut b = IndexedDatasetBuilder::create(&prefix, dtype).unwrap();
        for doc in &docs {
            for seq in doc {
                let s: Vec<u32> = seq.iter().map(|&t| t as u32).collect();
                b.add_sequence(&s).unwrap();
            }
            b.end_document();
        }
        assert_eq!((b.sequences(), b.documents(), b.tokens()), (5, 4, 11));
        b.finish().unwrap();
        assert_eq!(std::fs::read(with(&prefix, ".idx")).unwrap(), expected.0);
        assert_eq!(std::fs::read(with(&prefix, ".bin")).unwrap(), expected.1);
        // Only the two files: no temporary left behind.
        let names: Vec<String> = std::fs::read_dir(&dir.0)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .filter(|n| n.starts_with(dtype.name()))
            .collect();
        assert_eq!(names.len(), 2, "{names:?}");
    }
}

#[test]
fn an_unfinished_writer_leaves_nothing() {
    let dir = TempDir::new("unfinished");
    let prefix = dir.prefix("data");
    {
        let mut b = IndexedDatasetBuilder::create(&prefix, DType::U16).unwrap();
        b.add_sequence(&[1, 2, 3]).unwrap();
        b.end_document();
        let err = b.add_sequence(&[70_000]).unwrap_err();
        assert!(err.to_string().contains("70000"), "{err}");
    }
    assert_eq!(std::fs::read_dir(&dir.0).unwrap().count(), 0);
}

#[test]
fn an_empty_dataset_opens() {
    let dir = TempDir::new("empty");
    let prefix = dir.prefix("empty");
    write(&prefix, &spec_bytes(8, 2, &[]));
    let ds = IndexedDataset::open(&prefix).unwrap();
    assert!(ds.is_empty());
    assert_eq!(ds.documents(), 0);
}

/// Opens a corrupted copy of a good dataset and returns the error's message.
fn corrupt(
    dir: &TempDir,
    name: &str,
    change: impl FnOnce(&mut Vec<u8>, &mut Vec<u8>),
) -> (String, PathBuf) {
    let prefix = dir.prefix(name);
    let (mut idx, mut bin) = spec_bytes(8, 2, &sample_docs(9));
    change(&mut idx, &mut bin);
    write(&prefix, &(idx, bin));
    let err = IndexedDataset::open(&prefix).unwrap_err();
    (err.to_string(), prefix)
}

#[test]
fn corrupt_files_are_errors_naming_the_file_and_the_fault() {
    let dir = TempDir::new("corrupt");
    let idx = |p: &Path| with(p, ".idx").display().to_string();
    let bin = |p: &Path| with(p, ".bin").display().to_string();

    let (msg, p) = corrupt(&dir, "truncated-bin", |_, bin| bin.truncate(bin.len() - 1));
    assert!(
        msg.contains(&bin(&p)) && msg.contains("past the end of the file"),
        "{msg}"
    );

    let (msg, p) = corrupt(&dir, "magic", |idx, _| idx[0] = b'X');
    assert!(
        msg.contains(&idx(&p)) && msg.contains("wrong magic"),
        "{msg}"
    );

    let (msg, p) = corrupt(&dir, "version", |idx, _| idx[9] = 2);
    assert!(
        msg.contains(&idx(&p)) && msg.contains("unsupported index version 2"),
        "{msg}"
    );

    let (msg, p) = corrupt(&dir, "dtype", |idx, _| idx[17] = 9);
    assert!(
        msg.contains(&idx(&p)) && msg.contains("bad dtype code 9"),
        "{msg}"
    );

    let (msg, p) = corrupt(&dir, "float", |idx, _| idx[17] = 7);
    assert!(msg.contains(&idx(&p)) && msg.contains("float32"), "{msg}");

    let (msg, p) = corrupt(&dir, "truncated-idx", |idx, _| idx.truncate(idx.len() - 3));
    assert!(
        msg.contains(&idx(&p)) && msg.contains("index arrays run past the end of the file"),
        "{msg}"
    );

    let (msg, p) = corrupt(&dir, "header", |idx, _| idx.truncate(20));
    assert!(
        msg.contains(&idx(&p)) && msg.contains("truncated header"),
        "{msg}"
    );

    // A sequence count far too large for the file.
    let (msg, _) = corrupt(&dir, "count", |idx, _| {
        idx[18..26].copy_from_slice(&u64::MAX.to_le_bytes())
    });
    assert!(
        msg.contains("index arrays run past the end of the file"),
        "{msg}"
    );

    // A pointer past the end of .bin (the first sequence moved beyond it): open checks only the
    // last sequence, reading the first one and validating find it.
    let p = dir.prefix("pointer");
    let (mut idx_bytes, bin_bytes) = spec_bytes(8, 2, &sample_docs(9));
    let at = 34 + 4 * 5;
    idx_bytes[at..at + 8].copy_from_slice(&1000i64.to_le_bytes());
    write(&p, &(idx_bytes, bin_bytes));
    let ds = IndexedDataset::open(&p).unwrap();
    let msg = ds.sequence(0).unwrap_err().to_string();
    assert!(
        msg.contains(&bin(&p)) && msg.contains("sequence 0"),
        "{msg}"
    );
    let msg = ds.validate().unwrap_err().to_string();
    assert!(msg.contains("past the end of the file"), "{msg}");

    // A document index that does not end at the sequence count.
    let (msg, p) = corrupt(&dir, "documents", |idx, _| {
        let n = idx.len();
        idx[n - 8..].copy_from_slice(&4i64.to_le_bytes());
    });
    assert!(
        msg.contains(&idx(&p)) && msg.contains("document index"),
        "{msg}"
    );

    // Multimodal sequence modes after the document index: all-text (0) modes are read, others
    // refused.
    let prefix = dir.prefix("modes-text");
    let (mut idx_bytes, bin_bytes) = spec_bytes(8, 2, &sample_docs(9));
    idx_bytes.extend_from_slice(&[0; 5]);
    write(&prefix, &(idx_bytes, bin_bytes));
    assert_eq!(IndexedDataset::open(&prefix).unwrap().len(), 5);
    let (msg, _) = corrupt(&dir, "modes-image", |idx, _| {
        idx.extend_from_slice(&[0, 1, 0, 0, 0])
    });
    assert!(msg.contains("multimodal"), "{msg}");
    let (msg, _) = corrupt(&dir, "trailing", |idx, _| idx.extend_from_slice(&[0; 3]));
    assert!(msg.contains("3 unexpected bytes"), "{msg}");
}

#[test]
fn missing_files_are_named() {
    let dir = TempDir::new("missing");
    let prefix = dir.prefix("data");
    write(&prefix, &spec_bytes(8, 2, &sample_docs(9)));

    std::fs::remove_file(with(&prefix, ".idx")).unwrap();
    let err = IndexedDataset::open(&prefix).unwrap_err();
    assert!(matches!(err, DataError::Missing { .. }), "{err:?}");
    assert!(
        err.to_string()
            .contains(&with(&prefix, ".idx").display().to_string()),
        "{err}"
    );

    write(&prefix, &spec_bytes(8, 2, &sample_docs(9)));
    std::fs::remove_file(with(&prefix, ".bin")).unwrap();
    let err = IndexedDataset::open(&prefix).unwrap_err();
    assert!(
        err.to_string()
            .contains(&with(&prefix, ".bin").display().to_string()),
        "{err}"
    );
}
