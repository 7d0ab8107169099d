//! GGUF files (llama.cpp's format): header, metadata and quantized tensors, checked up front.

use std::fs::File;
use std::io::{BufReader, Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};

use candle_core::quantized::{gguf_file, GgmlDType, QTensor};
use candle_core::{DType, Device, Tensor};

use super::weights::{WeightName, WeightSource};
use crate::error::{Error, Result};
use ferrite_kernels::quant::{FloatFormat, KFormat, QuantMatrix, WeightFormat};

/// Tensor types the loader accepts, as named in error messages.
pub const SUPPORTED_TYPES: &str =
    "F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K";

/// An opened GGUF file whose header parsed and whose tensors all lie inside the file.
pub struct GgufFile {
    /// Metadata and tensor directory.
    pub content: gguf_file::Content,
    reader: BufReader<File>,
    path: PathBuf,
    device: Device,
}

impl std::fmt::Debug for GgufFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GgufFile")
            .field("path", &self.path)
            .finish_non_exhaustive()
    }
}

impl GgufFile {
    /// Opens `path`, parses the header and checks that no tensor runs past the end of the file.
    pub fn open(path: &Path, device: &Device) -> Result<Self> {
        let file = File::open(path).map_err(|e| Error::model(path, format!("cannot open: {e}")))?;
        let file_len = file.metadata().map(|m| m.len()).unwrap_or(0);
        let mut reader = BufReader::new(file);
        let content = gguf_file::Content::read(&mut reader).map_err(|e| {
            Error::model(
                path,
                format!("not a readable GGUF file ({e}); expected GGUF v2/v3 with tensor types {SUPPORTED_TYPES}"),
            )
        })?;
        for (name, info) in &content.tensor_infos {
            let elems = info.shape.elem_count();
            let bytes = (elems / info.ggml_dtype.block_size() * info.ggml_dtype.type_size()) as u64;
            let end = content.tensor_data_offset + info.offset + bytes;
            if end > file_len {
                return Err(Error::model(
                    path,
                    format!(
                        "file is truncated: tensor `{name}` needs bytes up to {end} but the file has {file_len}"
                    ),
                ));
            }
            if matches!(info.ggml_dtype, GgmlDType::Q8_1 | GgmlDType::Q8K) {
                return Err(Error::model(
                    path,
                    format!(
                        "tensor `{name}` has type {:?}, which is only an activation format; supported: {SUPPORTED_TYPES}",
                        info.ggml_dtype
                    ),
                ));
            }
        }
        Ok(GgufFile {
            content,
            reader,
            path: path.to_path_buf(),
            device: device.clone(),
        })
    }

    /// The file this was opened from.
    pub fn path(&self) -> &Path {
        &self.path
    }

    fn qtensor(&mut self, name: WeightName, dims: &[usize]) -> Result<QTensor> {
        let key = name.gguf();
        if !self.content.tensor_infos.contains_key(&key) {
            return Err(Error::model(&self.path, format!("missing tensor `{key}`")));
        }
        let t = self
            .content
            .tensor(&mut self.reader, &key, &self.device)
            .map_err(|e| Error::model(&self.path, format!("tensor `{key}`: {e}")))?;
        if t.shape().dims() != dims {
            return Err(Error::model(
                &self.path,
                format!(
                    "tensor `{key}` has shape {:?}, expected {dims:?}",
                    t.shape().dims()
                ),
            ));
        }
        Ok(t)
    }
}

impl GgufFile {
    /// The stored type of the `[r, c]` matrix `name` and the format it is held in, after
    /// checking its shape.
    fn matrix_info(
        &self,
        name: WeightName,
        (r, c): (usize, usize),
    ) -> Result<(GgmlDType, WeightFormat)> {
        let key = name.gguf();
        let Some(info) = self.content.tensor_infos.get(&key) else {
            return Err(Error::model(&self.path, format!("missing tensor `{key}`")));
        };
        if info.shape.dims() != [r, c] {
            return Err(Error::model(
                &self.path,
                format!(
                    "tensor `{key}` has shape {:?}, expected {:?}",
                    info.shape.dims(),
                    [r, c]
                ),
            ));
        }
        let dtype = info.ggml_dtype;
        let format = match dtype {
            GgmlDType::Q4_0 => WeightFormat::Q4_0,
            GgmlDType::Q4_1 => WeightFormat::Q4_1,
            GgmlDType::Q8_0 => WeightFormat::Q8_0,
            GgmlDType::Q5_0 => WeightFormat::Q5_0,
            GgmlDType::Q5_1 => WeightFormat::Q5_1,
            GgmlDType::Q2K => WeightFormat::K(KFormat::Q2K),
            GgmlDType::Q3K => WeightFormat::K(KFormat::Q3K),
            GgmlDType::Q4K => WeightFormat::K(KFormat::Q4K),
            GgmlDType::Q5K => WeightFormat::K(KFormat::Q5K),
            GgmlDType::Q6K => WeightFormat::K(KFormat::Q6K),
            GgmlDType::F32 => WeightFormat::Float(FloatFormat::F32),
            GgmlDType::F16 => WeightFormat::Float(FloatFormat::F16),
            GgmlDType::BF16 => WeightFormat::Float(FloatFormat::BF16),
            other => {
                return Err(Error::model(
                    &self.path,
                    format!("tensor `{key}` has type {other:?}; supported: {SUPPORTED_TYPES}"),
                ))
            }
        };
        Ok((dtype, format))
    }
}

impl WeightSource for GgufFile {
    fn device(&self) -> &Device {
        &self.device
    }

    fn is_f32(&self) -> bool {
        self.content
            .tensor_infos
            .values()
            .all(|t| t.ggml_dtype == GgmlDType::F32)
    }

    fn matrix_format(&self, name: WeightName, shape: (usize, usize)) -> Result<WeightFormat> {
        self.matrix_info(name, shape).map(|(_, format)| format)
    }

    fn matmul(&mut self, name: WeightName, (r, c): (usize, usize)) -> Result<QuantMatrix> {
        let (dtype, format) = self.matrix_info(name, (r, c))?;
        let key = name.gguf();
        let info = &self.content.tensor_infos[&key];
        // Read straight into the matrix's own buffer: one copy of the bytes, no more.
        let len = r * c / dtype.block_size() * dtype.type_size();
        let mut bytes = vec![0u8; len];
        let at = self.content.tensor_data_offset + info.offset;
        self.reader
            .seek(SeekFrom::Start(at))
            .and_then(|_| self.reader.read_exact(&mut bytes))
            .map_err(|e| Error::model(&self.path, format!("tensor `{key}`: cannot read: {e}")))?;
        QuantMatrix::from_gguf_vec(format, r, c, bytes).ok_or_else(|| {
            Error::model(
                &self.path,
                format!(
                    "tensor `{key}` ({dtype:?}, {r}x{c}) has rows that are not a whole number \
                     of its blocks"
                ),
            )
        })
    }

    fn vector(&mut self, name: WeightName, len: usize) -> Result<Tensor> {
        Ok(self
            .qtensor(name, &[len])?
            .dequantize(&self.device)?
            .to_dtype(DType::F32)?)
    }
}
