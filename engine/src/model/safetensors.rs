//! Hugging Face checkpoints: `model.safetensors` or a sharded index, in f32, f16 or bf16.

use std::collections::{BTreeSet, HashMap};
use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Tensor};
use serde::Deserialize;

use super::weights::{WeightName, WeightSource};
use crate::error::{Error, Result};
use ferrite_kernels::quant::{FloatFormat, QuantMatrix, WeightFormat};

/// All tensors of a checkpoint, converted to f32 on one device.
#[derive(Debug)]
pub struct SafetensorsWeights {
    tensors: HashMap<String, Tensor>,
    all_f32: bool,
    dir: PathBuf,
    device: Device,
}

#[derive(Deserialize)]
struct ShardIndex {
    weight_map: HashMap<String, String>,
}

#[derive(Deserialize)]
struct TensorHeader {
    dtype: String,
    shape: Vec<usize>,
    data_offsets: [usize; 2],
}

impl SafetensorsWeights {
    /// Loads `model.safetensors`, or every shard named by `model.safetensors.index.json`.
    pub fn load(dir: &Path, device: &Device) -> Result<Self> {
        let single = dir.join("model.safetensors");
        let index = dir.join("model.safetensors.index.json");
        let files: Vec<PathBuf> = if single.is_file() {
            vec![single]
        } else if index.is_file() {
            let text = std::fs::read_to_string(&index)
                .map_err(|e| Error::model(&index, format!("cannot read: {e}")))?;
            let idx: ShardIndex = serde_json::from_str(&text)
                .map_err(|e| Error::model(&index, format!("malformed shard index: {e}")))?;
            let names: BTreeSet<&String> = idx.weight_map.values().collect();
            names.into_iter().map(|n| dir.join(n)).collect()
        } else {
            return Err(Error::model(
                dir,
                "no weights: expected model.safetensors or model.safetensors.index.json",
            ));
        };
        let mut tensors = HashMap::new();
        let mut all_f32 = true;
        for file in files {
            check_header(&file)?;
            let loaded = candle_core::safetensors::load(&file, device)
                .map_err(|e| Error::model(&file, format!("cannot load safetensors: {e}")))?;
            for (name, t) in loaded {
                all_f32 &= t.dtype() == DType::F32;
                tensors.insert(name, t);
            }
        }
        Ok(SafetensorsWeights {
            tensors,
            all_f32,
            dir: dir.to_path_buf(),
            device: device.clone(),
        })
    }

    fn get(&self, name: WeightName, dims: &[usize]) -> Result<Tensor> {
        let key = name.hf();
        let t = self
            .tensors
            .get(&key)
            .ok_or_else(|| Error::model(&self.dir, format!("missing tensor `{key}`")))?;
        if t.dims() != dims {
            return Err(Error::model(
                &self.dir,
                format!("tensor `{key}` has shape {:?}, expected {dims:?}", t.dims()),
            ));
        }
        Ok(t.clone())
    }
}

/// Reads a safetensors header and refuses dtypes and extents the engine cannot use.
fn check_header(file: &Path) -> Result<()> {
    let bytes = std::fs::read(file).map_err(|e| Error::model(file, format!("cannot read: {e}")))?;
    let bad = |m: String| Err(Error::model(file, m));
    if bytes.len() < 8 {
        return bad("file is truncated: no safetensors header".into());
    }
    let mut len8 = [0u8; 8];
    len8.copy_from_slice(&bytes[..8]);
    let header_len = u64::from_le_bytes(len8) as usize;
    let Some(header) = bytes.get(8..8usize.saturating_add(header_len)) else {
        return bad(format!(
            "file is truncated: header of {header_len} bytes does not fit"
        ));
    };
    let header: HashMap<String, serde_json::Value> = serde_json::from_slice(header)
        .map_err(|e| Error::model(file, format!("malformed safetensors header: {e}")))?;
    let data_len = bytes.len() - 8 - header_len;
    for (name, value) in header {
        if name == "__metadata__" {
            continue;
        }
        let info: TensorHeader = serde_json::from_value(value).map_err(|e| {
            Error::model(
                file,
                format!("tensor `{name}`: malformed header entry: {e}"),
            )
        })?;
        if !matches!(info.dtype.as_str(), "F32" | "F16" | "BF16") {
            return bad(format!(
                "tensor `{name}` has dtype {}; supported: F32, F16, BF16",
                info.dtype
            ));
        }
        if info.data_offsets[1] > data_len || info.data_offsets[0] > info.data_offsets[1] {
            return bad(format!(
                "file is truncated: tensor `{name}` (shape {:?}) needs bytes up to {} of {data_len}",
                info.shape, info.data_offsets[1]
            ));
        }
    }
    Ok(())
}

impl WeightSource for SafetensorsWeights {
    fn device(&self) -> &Device {
        &self.device
    }

    fn is_f32(&self) -> bool {
        self.all_f32
    }

    fn matrix_format(&self, name: WeightName, (r, c): (usize, usize)) -> Result<WeightFormat> {
        let format = match self.get(name, &[r, c])?.dtype() {
            DType::BF16 => FloatFormat::BF16,
            DType::F16 => FloatFormat::F16,
            _ => FloatFormat::F32,
        };
        Ok(WeightFormat::Float(format))
    }

    fn matmul(&mut self, name: WeightName, (r, c): (usize, usize)) -> Result<QuantMatrix> {
        let t = self.get(name, &[r, c])?;
        // Read once: the matrix moves into the model in its checkpoint's encoding.
        self.tensors.remove(&name.hf());
        let flat = t.flatten_all()?;
        let (format, bytes): (FloatFormat, Vec<u8>) = match t.dtype() {
            DType::BF16 => (
                FloatFormat::BF16,
                flat.to_vec1::<half::bf16>()?
                    .iter()
                    .flat_map(|v| v.to_le_bytes())
                    .collect(),
            ),
            DType::F16 => (
                FloatFormat::F16,
                flat.to_vec1::<half::f16>()?
                    .iter()
                    .flat_map(|v| v.to_le_bytes())
                    .collect(),
            ),
            _ => (
                FloatFormat::F32,
                flat.to_dtype(DType::F32)?
                    .to_vec1::<f32>()?
                    .iter()
                    .flat_map(|v| v.to_le_bytes())
                    .collect(),
            ),
        };
        QuantMatrix::from_gguf(WeightFormat::Float(format), r, c, &bytes)
            .ok_or_else(|| Error::internal("a float matrix whose bytes do not fill it"))
    }

    fn vector(&mut self, name: WeightName, len: usize) -> Result<Tensor> {
        Ok(self.get(name, &[len])?.to_dtype(DType::F32)?)
    }
}
