//! `.safetensors` files in and out of checkpoints.
//!
//! Import keeps each file's header bytes exactly as written (as the blob
//! `safetensors.header:<file name>`), so export can rebuild a byte-identical file: the same
//! 8-byte length, the same header (metadata, key order and padding included), then each
//! tensor's bytes in offset order.

use bytes::Bytes;
use safetensors::tensor::{Metadata, TensorInfo, TensorView};

use crate::format::DType;

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

/// One file's layout: its header bytes, kept to rebuild the file, and where each tensor's bytes
/// lie in it.
#[derive(Debug)]
pub struct FileLayout {
    pub file_name: String,
    pub header: Bytes,
    pub tensors: Vec<TensorPlace>,
}

/// A tensor of a file and the byte range of the file that holds it.
#[derive(Debug)]
pub struct TensorPlace {
    pub name: String,
    pub dtype: DType,
    pub shape: Vec<u64>,
    pub offset: u64,
    pub len: u64,
}

/// The most header bytes a file may declare (the `safetensors` crate's own limit).
const HEADER_BYTES_MAX: u64 = 100_000_000;

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

/// The header's length from a file's first 8 bytes, checked against the file's length.
pub fn header_len(file_name: &str, prefix: &[u8], file_len: u64) -> Result<u64, SafetensorsError> {
    let malformed = |reason: String| malformed(file_name, reason);
    let Some(len) = prefix.get(..8) else {
        return Err(malformed(format!(
            "{file_len} bytes, shorter than the 8-byte header length"
        )));
    };
    let len = u64::from_le_bytes(len.try_into().expect("8 bytes"));
    if len > HEADER_BYTES_MAX || len > file_len.saturating_sub(8) {
        return Err(malformed(format!(
            "the header claims {len} bytes of a {file_len}-byte file"
        )));
    }
    Ok(len)
}

/// Checks a file's header as Python's `safetensors` does (JSON, known dtypes, offsets that tile
/// the data with each tensor's exact size, data that ends where the file ends) and says where
/// each tensor's bytes lie, reading none of them. `header` is the JSON after the 8-byte
/// length, `file_len` the whole file's length.
pub fn parse_layout(
    file_name: &str,
    header: Bytes,
    file_len: u64,
) -> Result<FileLayout, SafetensorsError> {
    check_file_name(file_name)?;
    let (tensors, data_end) = tensor_places(file_name, &header)?;
    let data_start = 8 + header.len() as u64;
    // Offsets come from the file: an end past u64 is as wrong as one past the file's end.
    if data_start.checked_add(data_end) != Some(file_len) {
        return Err(malformed(
            file_name,
            format!(
                "the header describes {data_end} bytes of tensor data, the file holds {}",
                file_len.saturating_sub(data_start)
            ),
        ));
    }
    Ok(FileLayout {
        file_name: file_name.to_string(),
        header,
        tensors,
    })
}

/// [`parse_layout`] of a whole file held in `data`.
#[cfg(test)]
pub fn parse_file(file_name: &str, data: &Bytes) -> Result<FileLayout, SafetensorsError> {
    let len = header_len(file_name, data, data.len() as u64)?;
    parse_layout(
        file_name,
        data.slice(8..8 + len as usize),
        data.len() as u64,
    )
}

/// The tensors a stored header describes, in file (offset) order: name, dtype, shape.
pub fn header_layout(
    file_name: &str,
    header: &[u8],
) -> Result<Vec<(String, DType, Vec<u64>)>, SafetensorsError> {
    let (tensors, _) = tensor_places(file_name, header)?;
    Ok(tensors
        .into_iter()
        .map(|place| (place.name, place.dtype, place.shape))
        .collect())
}

/// The tensors `header` (the JSON after the 8-byte length) describes, in offset order, with
/// where each lies in the file, and where the data they describe ends (relative to its start).
/// Deserialising checks the offsets and sizes (the crate's `Metadata::validate`).
fn tensor_places(
    file_name: &str,
    header: &[u8],
) -> Result<(Vec<TensorPlace>, u64), SafetensorsError> {
    let metadata: Metadata =
        serde_json::from_slice(header).map_err(|e| malformed(file_name, e.to_string()))?;
    let data_start = 8 + header.len() as u64;
    let infos = metadata.tensors();
    let mut data_end = 0;
    let mut tensors = Vec::new();
    for name in metadata.offset_keys() {
        let info = infos[&name];
        let dtype = to_dtype(file_name, &name, info.dtype)?;
        let (begin, end) = info.data_offsets;
        data_end = data_end.max(end as u64);
        let offset = data_start
            .checked_add(begin as u64)
            .ok_or_else(|| malformed(file_name, format!("tensor {name:?} starts past u64")))?;
        tensors.push(TensorPlace {
            name,
            dtype,
            shape: info.shape.iter().map(|d| *d as u64).collect(),
            offset,
            len: (end - begin) as u64,
        });
    }
    Ok((tensors, data_end))
}

fn malformed(file_name: &str, reason: String) -> SafetensorsError {
    SafetensorsError::Malformed {
        file: file_name.to_string(),
        reason,
    }
}

/// The 8-byte little-endian header length that starts every file.
pub fn length_prefix(header: &[u8]) -> [u8; 8] {
    (header.len() as u64).to_le_bytes()
}

/// The header of a new file of `tensors` (name, dtype, shape), as [`serialize`] writes it,
/// and where each tensor's bytes lie in the file, in file order, so that a caller can write
/// the bytes where they go without holding them all ([`serialize`]'s file is that header's
/// [`length_prefix`], the header, then each tensor's bytes in that order).
pub fn header(
    tensors: &[(String, DType, Vec<u64>)],
) -> Result<(Vec<u8>, Vec<TensorPlace>), SafetensorsError> {
    let malformed = |reason: String| malformed("model.safetensors", reason);
    let mut order: Vec<(&String, safetensors::Dtype, &Vec<u64>, DType)> = tensors
        .iter()
        .map(|(name, dtype, shape)| (name, from_dtype(*dtype), shape, *dtype))
        .collect();
    // The crate's order: larger alignment first, then by name.
    order.sort_by(|(a_name, a, ..), (b_name, b, ..)| b.cmp(a).then(a_name.cmp(b_name)));
    let mut infos = Vec::with_capacity(order.len());
    let mut offset = 0usize;
    for (name, st_dtype, shape, dtype) in &order {
        let shape: Vec<usize> = shape.iter().map(|d| *d as usize).collect();
        let len = shape
            .iter()
            .try_fold(dtype.element_bytes(), |len, d| len.checked_mul(*d))
            .ok_or_else(|| malformed(format!("tensor {name:?} has more bytes than fit usize")))?;
        let end = offset
            .checked_add(len)
            .ok_or_else(|| malformed("more tensor bytes than fit usize".into()))?;
        let info = TensorInfo {
            dtype: *st_dtype,
            shape,
            data_offsets: (offset, end),
        };
        infos.push(((*name).clone(), info));
        offset = end;
    }
    let metadata = Metadata::new(None, infos).map_err(|e| malformed(e.to_string()))?;
    let mut header = serde_json::to_vec(&metadata).map_err(|e| malformed(e.to_string()))?;
    header.resize(header.len().next_multiple_of(8), b' ');
    let (places, _) = tensor_places("model.safetensors", &header)?;
    Ok((header, places))
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
        let file = Bytes::from(file);
        let parsed = parse_file("m.safetensors", &file).unwrap();
        let layout = header_layout("m.safetensors", &parsed.header).unwrap();
        let mut rebuilt = length_prefix(&parsed.header).to_vec();
        rebuilt.extend_from_slice(&parsed.header);
        for (name, _, _) in &layout {
            let place = parsed.tensors.iter().find(|t| &t.name == name).unwrap();
            let range = place.offset as usize..(place.offset + place.len) as usize;
            rebuilt.extend_from_slice(&file[range]);
        }
        assert_eq!(rebuilt, file);
    }

    /// The header and order [`header`] gives, followed by the bytes in that order, are
    /// [`serialize`]'s file byte for byte: dtypes of every alignment, names out of order.
    #[test]
    fn a_header_and_its_order_make_the_serialized_file() {
        let tensors: Vec<(String, DType, Vec<u64>, Vec<u8>)> = vec![
            ("b".into(), DType::U8, vec![6], vec![7; 6]),
            ("a".into(), DType::F32, vec![2, 3], (0..24u8).collect()),
            ("c".into(), DType::F32, vec![1], vec![1, 2, 3, 4]),
            ("d".into(), DType::F64, vec![1], (10..18u8).collect()),
            ("e".into(), DType::BF16, vec![3], (30..36u8).collect()),
        ];
        let described: Vec<(String, DType, Vec<u64>)> = tensors
            .iter()
            .map(|(name, dtype, shape, _)| (name.clone(), *dtype, shape.clone()))
            .collect();
        let (header, places) = header(&described).unwrap();
        let names: Vec<&str> = places.iter().map(|place| place.name.as_str()).collect();
        assert_eq!(names, ["d", "a", "c", "e", "b"]);
        let mut file = length_prefix(&header).to_vec();
        file.extend_from_slice(&header);
        for name in &names {
            let (.., data) = tensors.iter().find(|(n, ..)| n == name).unwrap();
            file.extend_from_slice(data);
        }
        assert_eq!(file, serialize(&tensors).unwrap());
    }

    #[test]
    fn malformed_files_and_names_are_refused() {
        let parse = |bytes: &'static [u8]| parse_file("x.safetensors", &Bytes::from_static(bytes));
        assert!(parse(b"\x05\0\0\0\0\0\0\0{}").is_err());
        assert!(parse(b"\xff\xff\xff\xff\0\0\0\0{}").is_err());
        assert!(parse(b"").is_err());
        // A header whose tensor data the file does not hold, or holds more of.
        let header = br#"{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}"#;
        let mut file = (header.len() as u64).to_le_bytes().to_vec();
        file.extend_from_slice(header);
        file.extend_from_slice(&[0; 8]);
        assert!(parse_file("x.safetensors", &Bytes::from(file.clone())).is_ok());
        for bad_len in [file.len() - 1, file.len() + 1] {
            let mut bad = file.clone();
            bad.resize(bad_len, 0);
            assert!(parse_file("x.safetensors", &Bytes::from(bad)).is_err());
        }
        for bad in ["../x", "a/b", ".x", ""] {
            assert!(check_file_name(bad).is_err(), "{bad}");
        }
    }
}
