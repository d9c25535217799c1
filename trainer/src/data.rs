//! Training data: `trainer prepare` turns text into token files, and the sampler reads them.
//!
//! A prepared directory holds `train.tokens` and `val.tokens` (little-endian u16 GPT-2 token
//! ids, memory-mapped when read) and `index.json` (documents, token counts, the blake3 of each
//! file). Every document ends with the end-of-text token. The validation split is the last
//! `val_fraction` of the token stream.
//!
//! The sampler's order is a pure function of (seed, global sample index): sample `i` is window
//! `perm(seed, epoch)[i mod windows]` of `seq_len + 1` tokens, so the data position to save in
//! a checkpoint is one number, independent of how many ranks read.

use std::io::{BufRead, BufReader, Read};
use std::path::{Path, PathBuf};

use rand::seq::SliceRandom;
use rand::SeedableRng;
use serde::{Deserialize, Serialize};

pub const INDEX_FORMAT_VERSION: u32 = 1;
/// GPT-2's `<|endoftext|>`.
pub const END_OF_TEXT: u32 = 50256;
pub const GPT2_VOCAB: usize = 50257;

#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum DataError {
    #[error("{path}: {cause}")]
    Io { path: String, cause: std::io::Error },
    #[error("{path}:{line}: {reason}")]
    BadInput {
        path: String,
        line: usize,
        reason: String,
    },
    #[error("{path}: {reason}")]
    BadDataset { path: String, reason: String },
    #[error("no input text found in {0:?}; give text files, .jsonl or .jsonl.zst files, or folders of them")]
    Empty(Vec<String>),
    #[error("tokenizer {0:?} is not supported; use gpt2")]
    UnknownTokenizer(String),
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> DataError + '_ {
    move |cause| DataError::Io {
        path: path.display().to_string(),
        cause,
    }
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SplitInfo {
    pub file: String,
    pub tokens: u64,
    pub blake3: String,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SourceInfo {
    pub path: String,
    pub documents: u64,
    pub bytes: u64,
}

/// `index.json` of a prepared directory.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct DatasetIndex {
    pub format_version: u32,
    pub tokenizer: String,
    pub vocab_size: usize,
    pub end_of_text: u32,
    pub documents: u64,
    pub val_fraction: f64,
    pub train: SplitInfo,
    pub val: SplitInfo,
    pub sources: Vec<SourceInfo>,
}

/// Receives progress in input bytes.
pub trait PrepareProgress {
    fn set_total(&self, _bytes: u64) {}
    fn advance(&self, _bytes: u64) {}
}

impl PrepareProgress for () {}

/// Every input file under `inputs` (folders are walked, sorted for a stable order).
fn input_files(inputs: &[PathBuf]) -> Result<Vec<PathBuf>, DataError> {
    let mut files = Vec::new();
    for input in inputs {
        let metadata = std::fs::metadata(input).map_err(io(input))?;
        if !metadata.is_dir() {
            files.push(input.clone());
            continue;
        }
        let mut pending = vec![input.clone()];
        let mut found = Vec::new();
        while let Some(dir) = pending.pop() {
            for entry in std::fs::read_dir(&dir).map_err(io(&dir))? {
                let path = entry.map_err(io(&dir))?.path();
                if path.is_dir() {
                    pending.push(path);
                } else if !path
                    .file_name()
                    .is_some_and(|n| n.to_string_lossy().starts_with('.'))
                {
                    found.push(path);
                }
            }
        }
        found.sort();
        files.extend(found);
    }
    Ok(files)
}

/// Calls `document` with each document of `path`: the whole file for text, one `text` field
/// per line for `.jsonl` and `.jsonl.zst`.
fn read_documents(path: &Path, document: &mut dyn FnMut(&str)) -> Result<u64, DataError> {
    let name = path.to_string_lossy();
    let file = std::fs::File::open(path).map_err(io(path))?;
    let reader: Box<dyn Read> = if name.ends_with(".zst") {
        Box::new(zstd::stream::read::Decoder::new(file).map_err(io(path))?)
    } else {
        Box::new(file)
    };
    if !(name.ends_with(".jsonl") || name.ends_with(".jsonl.zst")) {
        let mut text = String::new();
        BufReader::new(reader)
            .read_to_string(&mut text)
            .map_err(|cause| match cause.kind() {
                std::io::ErrorKind::InvalidData => DataError::BadInput {
                    path: name.to_string(),
                    line: 0,
                    reason: "not UTF-8 text".into(),
                },
                _ => DataError::Io {
                    path: name.to_string(),
                    cause,
                },
            })?;
        document(&text);
        return Ok(1);
    }
    let mut count = 0;
    for (number, line) in BufReader::new(reader).lines().enumerate() {
        let line = line.map_err(io(path))?;
        if line.trim().is_empty() {
            continue;
        }
        let bad = |reason: String| DataError::BadInput {
            path: name.to_string(),
            line: number + 1,
            reason,
        };
        let value: serde_json::Value =
            serde_json::from_str(&line).map_err(|e| bad(format!("not JSON: {e}")))?;
        let text = value
            .get("text")
            .and_then(serde_json::Value::as_str)
            .ok_or_else(|| bad("no string field \"text\"".into()))?;
        document(text);
        count += 1;
    }
    Ok(count)
}

/// Tokenizes `inputs` into `out` (created if needed). Returns the index it wrote.
pub fn prepare(
    inputs: &[PathBuf],
    out: &Path,
    tokenizer: &str,
    val_fraction: f64,
    progress: &dyn PrepareProgress,
) -> Result<DatasetIndex, DataError> {
    if tokenizer != "gpt2" {
        return Err(DataError::UnknownTokenizer(tokenizer.to_string()));
    }
    if !(0.0..0.5).contains(&val_fraction) {
        return Err(DataError::BadDataset {
            path: out.display().to_string(),
            reason: format!("--val-fraction {val_fraction} must be in [0, 0.5)"),
        });
    }
    let files = input_files(inputs)?;
    let total: u64 = files
        .iter()
        .filter_map(|f| std::fs::metadata(f).ok())
        .map(|m| m.len())
        .sum();
    progress.set_total(total);
    let bpe = tiktoken_rs::r50k_base_singleton();
    let mut tokens: Vec<u16> = Vec::new();
    let mut sources = Vec::new();
    for file in &files {
        let bytes = std::fs::metadata(file).map_err(io(file))?.len();
        let documents = read_documents(file, &mut |text| {
            tokens.extend(bpe.encode_ordinary(text).into_iter().map(|t| t as u16));
            tokens.push(END_OF_TEXT as u16);
        })?;
        progress.advance(bytes);
        sources.push(SourceInfo {
            path: file.display().to_string(),
            documents,
            bytes,
        });
    }
    let documents: u64 = sources.iter().map(|s| s.documents).sum();
    if documents == 0 || tokens.len() < 2 {
        return Err(DataError::Empty(
            inputs.iter().map(|p| p.display().to_string()).collect(),
        ));
    }
    std::fs::create_dir_all(out).map_err(io(out))?;
    let val_tokens = ((tokens.len() as f64) * val_fraction).ceil() as usize;
    let (train, val) = tokens.split_at(tokens.len() - val_tokens);
    let index = DatasetIndex {
        format_version: INDEX_FORMAT_VERSION,
        tokenizer: tokenizer.to_string(),
        vocab_size: GPT2_VOCAB,
        end_of_text: END_OF_TEXT,
        documents,
        val_fraction,
        train: write_split(out, "train.tokens", train)?,
        val: write_split(out, "val.tokens", val)?,
        sources,
    };
    let index_path = out.join("index.json");
    let json = serde_json::to_vec_pretty(&index).expect("the index serialises");
    std::fs::write(&index_path, json).map_err(io(&index_path))?;
    Ok(index)
}

fn write_split(dir: &Path, file: &str, tokens: &[u16]) -> Result<SplitInfo, DataError> {
    let bytes: Vec<u8> = tokens.iter().flat_map(|t| t.to_le_bytes()).collect();
    let path = dir.join(file);
    std::fs::write(&path, &bytes).map_err(io(&path))?;
    Ok(SplitInfo {
        file: file.to_string(),
        tokens: tokens.len() as u64,
        blake3: blake3::hash(&bytes).to_hex().to_string(),
    })
}

/// One split of a prepared dataset, memory-mapped and verified against its index.
#[derive(Debug)]
pub struct TokenFile {
    map: memmap2::Mmap,
}

impl TokenFile {
    pub fn len(&self) -> usize {
        self.map.len() / 2
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn get(&self, index: usize) -> u32 {
        u32::from(u16::from_le_bytes([
            self.map[2 * index],
            self.map[2 * index + 1],
        ]))
    }
}

/// A prepared dataset: its index and both splits.
#[derive(Debug)]
pub struct Dataset {
    pub index: DatasetIndex,
    pub train: TokenFile,
    pub val: TokenFile,
}

impl Dataset {
    /// Opens a directory written by [`prepare`], checking the format and each file's hash.
    pub fn open(dir: &Path) -> Result<Self, DataError> {
        let bad = |reason: String| DataError::BadDataset {
            path: dir.display().to_string(),
            reason,
        };
        let index_path = dir.join("index.json");
        let text = std::fs::read(&index_path).map_err(|cause| match cause.kind() {
            std::io::ErrorKind::NotFound => bad("no index.json: prepare the data first with `trainer prepare --input ... --out DIR`".into()),
            _ => DataError::Io { path: index_path.display().to_string(), cause },
        })?;
        let index: DatasetIndex = serde_json::from_slice(&text)
            .map_err(|e| bad(format!("index.json is malformed: {e}")))?;
        if index.format_version != INDEX_FORMAT_VERSION {
            return Err(bad(format!("index format version {} is not supported (this build reads {INDEX_FORMAT_VERSION})", index.format_version)));
        }
        let open_split = |split: &SplitInfo| -> Result<TokenFile, DataError> {
            if split.file.contains('/') || split.file.starts_with('.') {
                return Err(bad(format!(
                    "index.json names a file outside the dataset: {:?}",
                    split.file
                )));
            }
            let path = dir.join(&split.file);
            let file = std::fs::File::open(&path).map_err(io(&path))?;
            // SAFETY: the map is read-only and private to this process. A concurrent writer to a
            // prepared dataset is unsupported; the hash check below catches a file that changed
            // before it was opened.
            #[allow(unsafe_code)]
            let map = unsafe { memmap2::Mmap::map(&file) }.map_err(io(&path))?;
            if map.len() as u64 != split.tokens * 2 {
                return Err(bad(format!(
                    "{} holds {} bytes, index.json says {} tokens",
                    split.file,
                    map.len(),
                    split.tokens
                )));
            }
            let hash = blake3::hash(&map).to_hex().to_string();
            if hash != split.blake3 {
                return Err(bad(format!("{} does not match its hash in index.json (damaged or replaced): prepare it again", split.file)));
            }
            let tokens = TokenFile { map };
            if let Some(position) =
                (0..tokens.len()).find(|i| tokens.get(*i) as usize >= index.vocab_size)
            {
                return Err(bad(format!(
                    "{} holds token {} at position {position}, outside the tokenizer's vocabulary of {}",
                    split.file,
                    tokens.get(position),
                    index.vocab_size
                )));
            }
            Ok(tokens)
        };
        let train = open_split(&index.train)?;
        let val = open_split(&index.val)?;
        Ok(Self { index, train, val })
    }
}

/// Hands out training windows in an order that depends only on (seed, sample index).
#[derive(Debug)]
pub struct Sampler {
    seed: u64,
    seq_len: usize,
    windows: usize,
    epoch: Option<(u64, Vec<u32>)>,
}

impl Sampler {
    /// `None` if the split holds fewer than `seq_len + 1` tokens.
    pub fn new(tokens: &TokenFile, seq_len: usize, seed: u64) -> Option<Self> {
        let windows = tokens.len().saturating_sub(1) / seq_len;
        (windows > 0).then_some(Self {
            seed,
            seq_len,
            windows,
            epoch: None,
        })
    }

    pub fn windows(&self) -> usize {
        self.windows
    }

    /// The `seq_len + 1` tokens of global sample `index` (inputs are the first `seq_len`,
    /// targets the last `seq_len`).
    pub fn sample(&mut self, tokens: &TokenFile, index: u64) -> Vec<u32> {
        let epoch = index / self.windows as u64;
        if self.epoch.as_ref().is_none_or(|(e, _)| *e != epoch) {
            let mut order: Vec<u32> = (0..self.windows as u32).collect();
            let mut rng = rand::rngs::StdRng::seed_from_u64(
                self.seed ^ epoch.wrapping_mul(0x9E37_79B9_7F4A_7C15),
            );
            order.shuffle(&mut rng);
            self.epoch = Some((epoch, order));
        }
        let order = &self.epoch.as_ref().expect("set above").1;
        let start = order[(index % self.windows as u64) as usize] as usize * self.seq_len;
        (start..start + self.seq_len + 1)
            .map(|i| tokens.get(i))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn text_jsonl_and_zstd_inputs_tokenize_and_round_trip() {
        let dir = tempfile::tempdir().unwrap();
        let input = dir.path().join("in");
        std::fs::create_dir_all(input.join("sub")).unwrap();
        std::fs::write(input.join("a.txt"), "Hello world. The quick brown fox.").unwrap();
        std::fs::write(
            input.join("sub/b.jsonl"),
            "{\"text\": \"First doc.\"}\n\n{\"text\": \"Second doc.\", \"id\": 2}\n",
        )
        .unwrap();
        let compressed = zstd::encode_all(&b"{\"text\": \"Zipped doc.\"}\n"[..], 3).unwrap();
        std::fs::write(input.join("sub/c.jsonl.zst"), compressed).unwrap();
        let out = dir.path().join("out");
        let index = prepare(&[input], &out, "gpt2", 0.0, &()).unwrap();
        assert_eq!(index.documents, 4);
        let dataset = Dataset::open(&out).unwrap();
        let ids: Vec<u32> = (0..dataset.train.len())
            .map(|i| dataset.train.get(i))
            .collect();
        assert_eq!(
            ids.iter().filter(|t| **t == END_OF_TEXT).count(),
            4,
            "one end-of-text per document"
        );
        let text: Vec<u32> = ids.iter().copied().filter(|t| *t != END_OF_TEXT).collect();
        let decoded = tiktoken_rs::r50k_base_singleton().decode(&text).unwrap();
        assert_eq!(
            decoded,
            "Hello world. The quick brown fox.First doc.Second doc.Zipped doc."
        );
    }

    #[test]
    fn bad_inputs_and_damaged_datasets_get_clear_errors() {
        let dir = tempfile::tempdir().unwrap();
        let jsonl = dir.path().join("x.jsonl");
        std::fs::write(&jsonl, "{\"text\": \"ok\"}\n{\"body\": \"no text\"}\n").unwrap();
        let error = prepare(&[jsonl], &dir.path().join("o"), "gpt2", 0.1, &())
            .unwrap_err()
            .to_string();
        assert!(
            error.ends_with("x.jsonl:2: no string field \"text\""),
            "{error}"
        );
        let missing = prepare(
            &[dir.path().join("nope")],
            &dir.path().join("o"),
            "gpt2",
            0.1,
            &(),
        )
        .unwrap_err()
        .to_string();
        assert!(missing.contains("nope"), "{missing}");
        let empty_dir = dir.path().join("empty");
        std::fs::create_dir(&empty_dir).unwrap();
        assert!(matches!(
            prepare(&[empty_dir], &dir.path().join("o"), "gpt2", 0.1, &()),
            Err(DataError::Empty(_))
        ));

        let text = dir.path().join("t.txt");
        std::fs::write(&text, "some text ".repeat(100)).unwrap();
        let out = dir.path().join("ok");
        prepare(&[text], &out, "gpt2", 0.1, &()).unwrap();
        let mut bytes = std::fs::read(out.join("train.tokens")).unwrap();
        bytes[0] ^= 1;
        std::fs::write(out.join("train.tokens"), bytes).unwrap();
        let error = Dataset::open(&out).unwrap_err().to_string();
        assert!(error.contains("does not match its hash"), "{error}");
        let error = Dataset::open(dir.path()).unwrap_err().to_string();
        assert!(error.contains("prepare the data first"), "{error}");
    }

    #[test]
    fn sample_order_depends_only_on_seed_and_index() {
        let dir = tempfile::tempdir().unwrap();
        let text = dir.path().join("t.txt");
        std::fs::write(
            &text,
            (0..3000).map(|i| format!("word{i} ")).collect::<String>(),
        )
        .unwrap();
        prepare(&[text], &dir.path().join("d"), "gpt2", 0.0, &()).unwrap();
        let data = Dataset::open(&dir.path().join("d")).unwrap();
        let mut a = Sampler::new(&data.train, 16, 7).unwrap();
        let mut b = Sampler::new(&data.train, 16, 7).unwrap();
        let windows = a.windows() as u64;
        let forward: Vec<Vec<u32>> = (0..3 * windows).map(|i| a.sample(&data.train, i)).collect();
        // Reading in another order (as other ranks would) gives the same sample for each index.
        for i in (0..3 * windows).rev().step_by(7) {
            assert_eq!(b.sample(&data.train, i), forward[i as usize]);
        }
        // Each epoch visits every window once, in a different order.
        let mut first: Vec<&Vec<u32>> = forward[..windows as usize].iter().collect();
        first.sort();
        first.dedup();
        assert_eq!(first.len() as u64, windows);
        assert_ne!(
            forward[..windows as usize],
            forward[windows as usize..2 * windows as usize]
        );
        let mut other = Sampler::new(&data.train, 16, 8).unwrap();
        let other_epoch: Vec<Vec<u32>> =
            (0..windows).map(|i| other.sample(&data.train, i)).collect();
        assert_ne!(
            other_epoch,
            forward[..windows as usize],
            "another seed gives another order"
        );
    }
}
