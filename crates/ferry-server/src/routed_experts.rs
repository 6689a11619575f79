//! `routed_experts` on the wire: a choice's expert routing (`ferry_engine::Finish::routing`,
//! one row per input token, `layers × top_k` expert ids) in the encodings RL trainers
//! read back.
//!
//! * vLLM 0.34 (`routed_experts` on each choice of `/v1/completions`,
//!   `/v1/chat/completions` and `/inference/v1/generate`): base64 of the `.npy` file
//!   `np.save(buf, array, allow_pickle=False)` writes (`vllm/utils/serial_utils.py`,
//!   `numpy2base64`) of an array of shape `(rows, layers, top_k)`, `uint8` when the model
//!   has at most 256 experts, else `uint16` (`routed_experts_capturer.py`'s
//!   `output_dtype_name`); its rows start at the request's `routed_experts_prompt_start`.
//! * SGLang (`meta_info.routed_experts` of `/generate`, asked for with
//!   `return_routed_experts`): base64 of the rows' raw bytes as little-endian `int32`,
//!   C order, no header (the detokenizer's `tensor.numpy().tobytes()` of its `int32` capture
//!   buffer); its rows start at `routed_experts_start_len`.
//!
//! The `.npy` writer is written here rather than taken from a crate: ferry writes one form of
//! the format (format 1.0, a 3-D array of `u1` or `<u2`), whose header is one line of
//! text, while the crates that write it (`npyz`, the maintained one) read and write every
//! dtype and pull in a Python-literal parser and big integers for it. The test below holds
//! the bytes to what numpy writes.

use base64::engine::general_purpose::STANDARD;
use base64::Engine as _;
use ferry_engine::{ExpertRouting, Finish};

/// numpy's `ARRAY_ALIGN`: the header is padded so the data starts at a multiple of it.
const ARRAY_ALIGN: usize = 64;

/// numpy's `GROWTH_AXIS_MAX_DIGITS`: spaces for the first axis to grow in place.
const GROWTH_AXIS_MAX_DIGITS: usize = 21;

/// The rows from `first_row` on (none if it is past them), and how many.
fn rows_from(routing: &ExpertRouting, first_row: usize) -> (&[u16], usize) {
    let width = routing.shape.width();
    let first = first_row.min(routing.rows());
    (&routing.ids[first * width..], routing.rows() - first)
}

/// The `.npy` bytes numpy's `np.save` writes for the rows from `first_row` on, as an array of
/// shape `(rows, layers, top_k)`: `uint8` for at most 256 experts, else little-endian
/// `uint16`.
pub fn npy(routing: &ExpertRouting, first_row: usize) -> Vec<u8> {
    let shape = routing.shape;
    let (ids, n_rows) = rows_from(routing, first_row);
    let narrow = shape.num_experts <= 256;
    let descr = if narrow { "|u1" } else { "<u2" };
    let mut header = format!(
        "{{'descr': '{descr}', 'fortran_order': False, 'shape': ({n_rows}, {}, {}), }}",
        shape.layers, shape.top_k
    );
    let digits = n_rows.to_string().len();
    header.push_str(&" ".repeat(GROWTH_AXIS_MAX_DIGITS.saturating_sub(digits)));
    // Magic (6), version (2), header length (2), header, `\n`; numpy pads with at least one
    // space, a whole `ARRAY_ALIGN` when the rest is aligned already.
    let pad = ARRAY_ALIGN - (10 + header.len() + 1) % ARRAY_ALIGN;
    header.push_str(&" ".repeat(pad));
    header.push('\n');
    let header_len = u16::try_from(header.len()).expect("a routing header is short");
    let mut out = Vec::with_capacity(10 + header.len() + ids.len() * 2);
    out.extend_from_slice(b"\x93NUMPY\x01\x00");
    out.extend_from_slice(&header_len.to_le_bytes());
    out.extend_from_slice(header.as_bytes());
    if narrow {
        // The core refuses ids at or above the model's expert count.
        out.extend(ids.iter().map(|&id| id as u8));
    } else {
        out.extend(ids.iter().flat_map(|id| id.to_le_bytes()));
    }
    out
}

/// vLLM's `routed_experts` of a finished choice: base64 of [`npy`] from row `first_row`;
/// `None` without routing (the server does not capture it, or the request ended before
/// its first token).
pub fn vllm(finish: Option<&Finish>, first_row: usize) -> Option<String> {
    let routing = finish?.routing.as_ref()?;
    Some(STANDARD.encode(npy(routing, first_row)))
}

/// SGLang's `meta_info.routed_experts` of a finished choice: base64 of the rows from
/// `first_row` on as little-endian `int32`s; `None` without routing.
pub fn sglang(finish: Option<&Finish>, first_row: usize) -> Option<String> {
    let routing = finish?.routing.as_ref()?;
    let (ids, _) = rows_from(routing, first_row);
    let bytes: Vec<u8> = ids
        .iter()
        .flat_map(|&id| i32::from(id).to_le_bytes())
        .collect();
    Some(STANDARD.encode(bytes))
}

#[cfg(test)]
mod tests {
    use super::*;
    use ferry_engine::RoutingShape;

    fn routing(layers: usize, top_k: usize, num_experts: usize, ids: &[u16]) -> ExpertRouting {
        ExpertRouting {
            shape: RoutingShape {
                layers,
                top_k,
                num_experts,
            },
            ids: ids.to_vec(),
        }
    }

    /// The bytes numpy 2.4.6 writes, `base64.b64encode` of `np.save(buf, a,
    /// allow_pickle=False)` for `a` = `np.arange(4, dtype=np.uint8).reshape(2, 1, 2)`,
    /// `np.array([300, 7], dtype=np.uint16).reshape(1, 2, 1)` and
    /// `np.zeros((0, 3, 2), dtype=np.uint8)`.
    #[test]
    fn npy_bytes_are_numpys() {
        let cases = [
            (
                npy(&routing(1, 2, 4, &[9, 9, 0, 1, 2, 3]), 1),
                "k05VTVBZAQB2AHsnZGVzY3InOiAnfHUxJywgJ2ZvcnRyYW5fb3JkZXInOiBGYWxzZSwgJ3NoYXBlJzogKDIsIDEsIDIpLCB9ICAgICAgICAgICAgICAgICAgICAgICAgICAgICAgICAgICAgICAgICAgICAgICAgICAgICAgIAoAAQID",
            ),
            (
                npy(&routing(2, 1, 301, &[300, 7]), 0),
                "k05VTVBZAQB2AHsnZGVzY3InOiAnPHUyJywgJ2ZvcnRyYW5fb3JkZXInOiBGYWxzZSwgJ3NoYXBlJzogKDEsIDIsIDEpLCB9ICAgICAgICAgICAgICAgICAgICAgICAgICAgICAgICAgICAgICAgICAgICAgICAgICAgICAgIAosAQcA",
            ),
            (
                npy(&routing(3, 2, 8, &[1, 2, 3, 4, 5, 6]), 1),
                "k05VTVBZAQB2AHsnZGVzY3InOiAnfHUxJywgJ2ZvcnRyYW5fb3JkZXInOiBGYWxzZSwgJ3NoYXBlJzogKDAsIDMsIDIpLCB9ICAgICAgICAgICAgICAgICAgICAgICAgICAgICAgICAgICAgICAgICAgICAgICAgICAgICAgIAo=",
            ),
        ];
        for (bytes, golden) in cases {
            assert_eq!(STANDARD.encode(&bytes), golden);
        }
    }

    /// The header stays aligned, with numpy's padding rule, however many rows there are.
    #[test]
    fn npy_data_starts_at_a_multiple_of_64() {
        for n_rows in [0, 1, 9, 10, 99_999, 1_234_567] {
            let r = routing(1, 1, 2, &vec![1; n_rows]);
            let bytes = npy(&r, 0);
            let header_len = u16::from_le_bytes([bytes[8], bytes[9]]) as usize;
            assert_eq!((10 + header_len) % ARRAY_ALIGN, 0, "{n_rows}");
            assert_eq!(bytes[10 + header_len - 1], b'\n');
            assert_eq!(bytes.len(), 10 + header_len + n_rows);
        }
    }

    #[test]
    fn sglang_rows_are_little_endian_int32() {
        let r = routing(1, 2, 400, &[1, 2, 300, 4]);
        let finish = Finish {
            reason: ferry_engine::FinishReason::Stop,
            stop_reason: None,
            n_prompt_tokens: 2,
            n_output_tokens: 1,
            n_cached_tokens: 0,
            weight_versions: Vec::new(),
            lora_versions: Vec::new(),
            export: None,
            kv_transfer_params: None,
            message: None,
            routing: Some(r),
        };
        let got = STANDARD.decode(sglang(Some(&finish), 1).unwrap()).unwrap();
        assert_eq!(got, [44, 1, 0, 0, 4, 0, 0, 0]);
        assert_eq!(vllm(None, 0), None);
    }
}
