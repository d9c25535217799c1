//! `.safetensors` files in and out of checkpoints.
//!
//! Import keeps each file's header bytes exactly as written (as the blob
//! `safetensors.header:<file name>`), so export can rebuild a byte-identical file: the same
//! 8-byte length, the same header (metadata, key order and padding included), then each
//! tensor's bytes in offset order.

use bytes::Bytes;
use safetensors::tensor::{Metadata, SafeTensors, TensorView};

use crate::format::DType;
use crate::store::TensorData;

/// Blob name prefix under which an imported file's header is kept.
pub const HEADER_BLOB_PREFIX: &str = "safetensors.header:";

#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum SafetensorsError {
    #[error("{file}: not a valid safetensors file: {reason}")]
    Malformed { file: String, reason: String },
    #[error("{file}: tensor {tensor:?} has dtype {dtype}, which Lazarus does not store")]
    UnsupportedDtype {
        file: String,
        tensor: String,
        dtype: String,
    },
    #[error("file name {0:?} is not allowed: use letters, digits, '.', '_' and '-', not starting with '.'")]
    BadFileName(String),
}

/// One parsed file: its header bytes and its tensors (slices of the file's buffer).
#[derive(Debug)]
pub struct ImportedFile {
    pub file_name: String,
    pub header: Bytes,
    pub tensors: Vec<TensorData>,
}

pub fn check_file_name(name: &str) -> Result<(), SafetensorsError> {
    let valid = !name.is_empty()
        && name.len() <= 255
        && !name.starts_with('.')
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b));
    if valid {
        Ok(())
    } else {
        Err(SafetensorsError::BadFileName(
            name.chars().take(100).collect(),
        ))
    }
}

fn to_dtype(
    file: &str,
    tensor: &str,
    dtype: safetensors::Dtype,
) -> Result<DType, SafetensorsError> {
    let name = format!("{dtype:?}");
    serde_json::from_value(serde_json::Value::String(name.clone())).map_err(|_| {
        SafetensorsError::UnsupportedDtype {
            file: file.to_string(),
            tensor: tensor.to_string(),
            dtype: name,
        }
    })
}

fn from_dtype(dtype: DType) -> safetensors::Dtype {
    serde_json::from_value(serde_json::Value::String(dtype.name()))
        .expect("every Lazarus dtype is a safetensors dtype")
}

/// Parses a whole file held in `data`, validating it as Python's `safetensors` would.
pub fn parse_file(file_name: &str, data: Bytes) -> Result<ImportedFile, SafetensorsError> {
    check_file_name(file_name)?;
    let malformed = |reason: String| SafetensorsError::Malformed {
        file: file_name.to_string(),
        reason,
    };
    let parsed = SafeTensors::deserialize(&data).map_err(|e| malformed(e.to_string()))?;
    let (header_len, metadata) =
        SafeTensors::read_metadata(&data).map_err(|e| malformed(e.to_string()))?;
    let data_start = 8 + header_len;
    let infos = metadata.tensors();
    let mut tensors = Vec::new();
    for name in metadata.offset_keys() {
        let info = infos[&name];
        parsed.tensor(&name).map_err(|e| malformed(e.to_string()))?;
        let dtype = to_dtype(file_name, &name, info.dtype)?;
        let (begin, end) = info.data_offsets;
        tensors.push(TensorData::whole(
            name,
            dtype,
            info.shape.iter().map(|d| *d as u64).collect(),
            data.slice(data_start + begin..data_start + end),
        ));
    }
    Ok(ImportedFile {
        file_name: file_name.to_string(),
        header: data.slice(8..data_start),
        tensors,
    })
}

/// The tensors a stored header describes, in file (offset) order: name, dtype, shape.
pub fn header_layout(
    file_name: &str,
    header: &[u8],
) -> Result<Vec<(String, DType, Vec<u64>)>, SafetensorsError> {
    let malformed = |reason: String| SafetensorsError::Malformed {
        file: file_name.to_string(),
        reason,
    };
    let metadata: Metadata =
        serde_json::from_slice(header).map_err(|e| malformed(e.to_string()))?;
    let infos = metadata.tensors();
    metadata
        .offset_keys()
        .into_iter()
        .map(|name| {
            let info = infos[&name];
            Ok((
                name.clone(),
                to_dtype(file_name, &name, info.dtype)?,
                info.shape.iter().map(|d| *d as u64).collect(),
            ))
        })
        .collect()
}

/// The 8-byte little-endian header length that starts every file.
pub fn length_prefix(header: &[u8]) -> [u8; 8] {
    (header.len() as u64).to_le_bytes()
}

/// A new file holding `tensors` (sorted by name), for checkpoints that were not imported.
pub fn serialize(
    tensors: &[(String, DType, Vec<u64>, Vec<u8>)],
) -> Result<Vec<u8>, SafetensorsError> {
    let views: Vec<(String, TensorView<'_>)> = tensors
        .iter()
        .map(|(name, dtype, shape, data)| {
            let shape: Vec<usize> = shape.iter().map(|d| *d as usize).collect();
            TensorView::new(from_dtype(*dtype), shape, data)
                .map(|view| (name.clone(), view))
                .map_err(|e| SafetensorsError::Malformed {
                    file: "model.safetensors".into(),
                    reason: e.to_string(),
                })
        })
        .collect::<Result<_, _>>()?;
    safetensors::serialize(views, None).map_err(|e| SafetensorsError::Malformed {
        file: "model.safetensors".into(),
        reason: e.to_string(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_file_round_trips_byte_for_byte() {
        let a: Vec<u8> = (0..24u8).collect();
        let b: Vec<u8> = vec![7; 6];
        let file = serialize(&[
            ("b".into(), DType::U8, vec![6], b.clone()),
            ("a".into(), DType::F32, vec![2, 3], a.clone()),
        ])
        .unwrap();
        let parsed = parse_file("m.safetensors", Bytes::from(file.clone())).unwrap();
        let layout = header_layout("m.safetensors", &parsed.header).unwrap();
        let mut rebuilt = length_prefix(&parsed.header).to_vec();
        rebuilt.extend_from_slice(&parsed.header);
        for (name, _, _) in &layout {
            let tensor = parsed.tensors.iter().find(|t| &t.name == name).unwrap();
            rebuilt.extend_from_slice(&tensor.data);
        }
        assert_eq!(rebuilt, file);
    }

    #[test]
    fn malformed_files_and_names_are_refused() {
        assert!(parse_file("x.safetensors", Bytes::from_static(b"\x05\0\0\0\0\0\0\0{}")).is_err());
        assert!(parse_file(
            "x.safetensors",
            Bytes::from_static(b"\xff\xff\xff\xff\0\0\0\0{}")
        )
        .is_err());
        assert!(parse_file("x.safetensors", Bytes::new()).is_err());
        for bad in ["../x", "a/b", ".x", ""] {
            assert!(check_file_name(bad).is_err(), "{bad}");
        }
    }
}
