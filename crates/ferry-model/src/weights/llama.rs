//! The Llama-family weights in the layout the forward wants, built from a [`WeightStore`]
//! (Hugging Face names) after checking every tensor's presence and shape.
//!
//! Matrices ([`Matrix`]) stay in the precision they were stored in, one segment per tensor;
//! vectors (norm weights, biases: a few kilobytes a layer, read by element-wise code) are
//! dequantized to f32.
//!
//! Q/K/V are fused into one `[(n_heads + 2 n_kv_heads) · head_dim, hidden]` matrix and
//! gate/up into one `[2 · intermediate, hidden]` matrix, so a layer runs three matmuls plus
//! the output projection instead of six, with one parallel dispatch each. Fusing only stacks
//! rows: each output element is still the same dot product, so the bits do not change.
//! Everything lives in [`LlamaWeights`], so an in-place weight update is "build a new one
//! and swap it in".

use crate::config::LlamaConfig;
use crate::weights::buf::{ByteBuf, WeightBuf};
use crate::weights::matrix::{Matrix, Segment};
use crate::weights::store::WeightStore;

/// What is wrong with a config or a weight store, naming the field or tensor.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    #[error("missing tensor {name}")]
    MissingTensor { name: String },
    #[error("tensor {name} has shape {got:?}, expected {expected:?}")]
    BadShape {
        name: String,
        expected: Vec<usize>,
        got: Vec<usize>,
    },
    #[error("tensor {name} has {got} values, but its shape {shape:?} needs {expected}")]
    BadLength {
        name: String,
        shape: Vec<usize>,
        expected: usize,
        got: usize,
    },
    #[error("tensor {name}: {source}")]
    BadStored {
        name: String,
        #[source]
        source: crate::weights::matrix::SegmentError,
    },
    #[error("invalid config: {field}: {message}")]
    InvalidConfig {
        field: &'static str,
        message: String,
    },
}

/// One decoder layer.
#[derive(Debug, Clone)]
pub struct LayerWeights {
    pub input_norm: WeightBuf,
    /// `[q; k; v]` rows, each `hidden` wide (three segments).
    pub qkv: Matrix,
    /// `[q; k; v]` bias (Qwen2/2.5).
    pub qkv_bias: Option<WeightBuf>,
    /// Per-head RMSNorm weights on q and k (Qwen3), `head_dim` each.
    pub q_norm: Option<WeightBuf>,
    pub k_norm: Option<WeightBuf>,
    pub o_proj: Matrix,
    /// `o_proj` bias (Llama and Qwen3 with `attention_bias`).
    pub o_bias: Option<WeightBuf>,
    pub post_norm: WeightBuf,
    /// `[gate; up]` rows, each `hidden` wide (two segments): the dense MLP, or Qwen2-MoE's
    /// shared expert in an MoE layer; empty in other MoE layers.
    pub gate_up: Matrix,
    pub down: Matrix,
    /// The router (`[num_experts, hidden]`), in MoE layers.
    pub router: Option<Matrix>,
    /// Each expert's MLP, in MoE layers (empty otherwise).
    pub experts: Vec<ExpertWeights>,
    /// Qwen2-MoE's shared-expert gate (`[1, hidden]`).
    pub shared_gate: Option<Matrix>,
}

/// One expert's MLP: `[gate; up]` rows (two segments) and `down`.
#[derive(Debug, Clone)]
pub struct ExpertWeights {
    pub gate_up: Matrix,
    pub down: Matrix,
}

impl LayerWeights {
    /// The layer's matrices, attention first, then the MLP's (router, experts in order,
    /// shared expert and its gate).
    pub fn matrices(&self) -> impl Iterator<Item = &Matrix> {
        [&self.qkv, &self.o_proj]
            .into_iter()
            .chain(self.router.iter())
            .chain(self.experts.iter().flat_map(|e| [&e.gate_up, &e.down]))
            .chain([&self.gate_up, &self.down])
            .chain(self.shared_gate.iter())
    }

    /// [`Self::matrices`], mutably, in the same order.
    pub fn matrices_mut(&mut self) -> impl Iterator<Item = &mut Matrix> {
        [&mut self.qkv, &mut self.o_proj]
            .into_iter()
            .chain(self.router.iter_mut())
            .chain(
                self.experts
                    .iter_mut()
                    .flat_map(|e| [&mut e.gate_up, &mut e.down]),
            )
            .chain([&mut self.gate_up, &mut self.down])
            .chain(self.shared_gate.iter_mut())
    }
}

/// The whole model's weights.
///
/// No buffer comes from malloc ([`WeightBuf`]: its own memory mapping; [`ByteBuf`]: a range
/// of a huge-page slab), so weights replaced by an update or dropped by sleep give their
/// memory back to the OS wherever they are freed.
#[derive(Debug, Clone)]
pub struct LlamaWeights {
    pub embed: Matrix,
    pub layers: Vec<LayerWeights>,
    pub norm: WeightBuf,
    /// `None` with tied embeddings: the head is `embed`.
    pub lm_head: Option<Matrix>,
}

impl LlamaWeights {
    /// Checks `config` and copies the tensors it needs out of `store`.
    pub fn from_store(config: &LlamaConfig, store: &WeightStore) -> Result<Self, ModelError> {
        check_config(config)?;
        let h = config.hidden_size;
        let getter = Getter { store };
        let layers = (0..config.num_hidden_layers)
            .map(|l| layer_from_store(config, &getter, l))
            .collect::<Result<_, _>>()?;
        let lm_head = if config.tie_word_embeddings {
            None
        } else {
            Some(getter.matrix(&[("lm_head.weight".into(), vec![config.vocab_size, h])])?)
        };
        Ok(Self {
            embed: getter.matrix(&[(
                "model.embed_tokens.weight".into(),
                vec![config.vocab_size, h],
            )])?,
            layers,
            norm: getter.get("model.norm.weight", &[h])?,
            lm_head,
        })
    }

    /// The output projection (`vocab × hidden`).
    pub fn head(&self) -> &Matrix {
        self.lm_head.as_ref().unwrap_or(&self.embed)
    }

    /// Bytes of all weights held.
    pub fn total_bytes(&self) -> usize {
        let head = self.lm_head.as_ref().map_or(0, Matrix::n_bytes);
        self.embed.n_bytes() + head + self.layer_bytes() + self.norm.n_bytes()
    }

    /// Bytes of weights one decode step reads: every layer, the final norm and the head (not
    /// the embedding table, of which a step reads one row per token, unless it is the head).
    pub fn bytes_read_per_step(&self) -> usize {
        self.layer_bytes() + self.norm.n_bytes() + self.head().n_bytes()
    }

    /// Bytes of the weights one token reads (at batch 1): [`Self::bytes_read_per_step`] with
    /// only `top_k` of each MoE layer's experts, the average expert's size (experts of one
    /// layer are the same size unless an update brought another dtype).
    pub fn active_bytes_per_token(&self, config: &LlamaConfig) -> usize {
        self.bytes_read_per_step() - self.unrouted(config, Matrix::n_bytes)
    }

    /// `measure` summed over the expert matrices a token does not use: in each MoE layer,
    /// all its experts' but `top_k` of them (at the average expert's; experts of one layer
    /// are the same size unless an update brought another dtype). 0 for a dense model.
    fn unrouted(&self, config: &LlamaConfig, measure: impl Fn(&Matrix) -> usize) -> usize {
        let Some(moe) = &config.moe else {
            return 0;
        };
        self.layers
            .iter()
            .filter(|l| !l.experts.is_empty())
            .map(|l| {
                let experts: usize = l
                    .experts
                    .iter()
                    .map(|e| measure(&e.gate_up) + measure(&e.down))
                    .sum();
                experts - experts * moe.top_k / l.experts.len()
            })
            .sum()
    }

    /// Every layer's matrices, layer by layer ([`LayerWeights::matrices`]).
    pub fn layer_matrices(&self) -> impl Iterator<Item = &Matrix> {
        self.layers.iter().flat_map(LayerWeights::matrices)
    }

    /// Floating-point operations (a multiply-add counts 2) of one token's matmuls: every
    /// layer's matrices (of an MoE layer's experts, the `top_k` a token is routed to), and
    /// the head when the token samples.
    pub fn matmul_flops_per_token(&self, config: &LlamaConfig, with_head: bool) -> u64 {
        let elems = |m: &Matrix| m.n_rows() * m.k();
        let layers: usize =
            self.layer_matrices().map(elems).sum::<usize>() - self.unrouted(config, elems);
        2 * (layers + if with_head { elems(self.head()) } else { 0 }) as u64
    }

    fn layer_bytes(&self) -> usize {
        let opt = |v: &Option<WeightBuf>| v.as_ref().map_or(0, WeightBuf::n_bytes);
        self.layers
            .iter()
            .map(|l| {
                l.input_norm.n_bytes()
                    + opt(&l.qkv_bias)
                    + opt(&l.q_norm)
                    + opt(&l.k_norm)
                    + opt(&l.o_bias)
                    + l.post_norm.n_bytes()
                    + l.matrices().map(Matrix::n_bytes).sum::<usize>()
            })
            .sum()
    }
}

fn check_config(c: &LlamaConfig) -> Result<(), ModelError> {
    let bad = |field, message: String| Err(ModelError::InvalidConfig { field, message });
    for (field, v) in [
        ("vocab_size", c.vocab_size),
        ("hidden_size", c.hidden_size),
        ("intermediate_size", c.intermediate_size),
        ("num_hidden_layers", c.num_hidden_layers),
        ("num_attention_heads", c.num_attention_heads),
        ("num_key_value_heads", c.num_key_value_heads),
        ("head_dim", c.head_dim),
    ] {
        if v == 0 {
            return bad(field, "must be positive".into());
        }
    }
    if !c.head_dim.is_multiple_of(2) {
        return bad(
            "head_dim",
            format!("{} is odd; rope needs pairs", c.head_dim),
        );
    }
    if !c.num_attention_heads.is_multiple_of(c.num_key_value_heads) {
        return bad(
            "num_key_value_heads",
            format!(
                "{} does not divide num_attention_heads {}",
                c.num_key_value_heads, c.num_attention_heads
            ),
        );
    }
    if !(c.rms_norm_eps.is_finite() && c.rms_norm_eps >= 0.0) {
        return bad(
            "rms_norm_eps",
            format!("{} is not a valid epsilon", c.rms_norm_eps),
        );
    }
    if !(c.rope_theta.is_finite() && c.rope_theta > 0.0) {
        return bad("rope_theta", format!("{} is not positive", c.rope_theta));
    }
    if let Some(moe) = &c.moe {
        if moe.top_k == 0 || moe.top_k > moe.num_experts {
            return bad(
                "num_experts_per_tok",
                format!(
                    "{} is not between 1 and the {} experts",
                    moe.top_k, moe.num_experts
                ),
            );
        }
        if moe.num_experts > usize::from(u16::MAX) + 1 {
            return bad(
                "num_experts",
                format!("{} is more than 65536", moe.num_experts),
            );
        }
        if moe.sparse_layers.len() != c.num_hidden_layers {
            return bad(
                "mlp_only_layers",
                format!(
                    "{} layers' MLP kinds for {} layers",
                    moe.sparse_layers.len(),
                    c.num_hidden_layers
                ),
            );
        }
        if moe.expert_intermediate_size == 0 {
            return bad("moe_intermediate_size", "must be positive".into());
        }
    }
    Ok(())
}

/// Looks tensors up by name and checks their shapes.
struct Getter<'a> {
    store: &'a WeightStore,
}

impl Getter<'_> {
    /// A vector, as f32 whatever its stored precision.
    fn get(&self, name: &str, shape: &[usize]) -> Result<WeightBuf, ModelError> {
        if let Some(t) = self.store.stored.get(name) {
            check_shape(name, shape, &t.shape)?;
            return Ok(WeightBuf::from_slice(&t.to_f32()));
        }
        self.get_slice(name, shape).map(WeightBuf::from_slice)
    }

    /// Matrices stacked row-wise, one segment each, in their stored precision.
    fn matrix(&self, parts: &[(String, Vec<usize>)]) -> Result<Matrix, ModelError> {
        let k = parts[0].1[1];
        let segments = parts
            .iter()
            .map(|(name, shape)| self.segment(name, shape))
            .collect::<Result<_, _>>()?;
        Ok(Matrix::new(k, segments))
    }

    fn segment(&self, name: &str, shape: &[usize]) -> Result<Segment, ModelError> {
        let (rows, k) = (shape[0], shape[1]);
        let Some(t) = self.store.stored.get(name) else {
            return Ok(Segment::from_f32(k, self.get_slice(name, shape)?));
        };
        check_shape(name, shape, &t.shape)?;
        Segment::new(t.dtype, rows, k, ByteBuf::from_slice(&t.bytes)).map_err(|source| {
            ModelError::BadStored {
                name: name.to_string(),
                source,
            }
        })
    }

    fn get_slice(&self, name: &str, shape: &[usize]) -> Result<&[f32], ModelError> {
        let t = self
            .store
            .get(name)
            .ok_or_else(|| ModelError::MissingTensor {
                name: name.to_string(),
            })?;
        check_shape(name, shape, &t.shape)?;
        let expected: usize = shape.iter().product();
        if t.data.len() != expected {
            return Err(ModelError::BadLength {
                name: name.to_string(),
                shape: shape.to_vec(),
                expected,
                got: t.data.len(),
            });
        }
        Ok(&t.data)
    }

    /// Several vectors stacked, in order, as f32.
    fn stacked(&self, parts: &[(String, Vec<usize>)]) -> Result<WeightBuf, ModelError> {
        let slices = parts
            .iter()
            .map(|(name, shape)| self.get(name, shape))
            .collect::<Result<Vec<_>, _>>()?;
        let mut out = WeightBuf::zeroed(slices.iter().map(|s| s.len()).sum());
        let mut at = 0;
        for s in slices {
            out[at..at + s.len()].copy_from_slice(&s);
            at += s.len();
        }
        Ok(out)
    }
}

fn check_shape(name: &str, expected: &[usize], got: &[usize]) -> Result<(), ModelError> {
    if got == expected {
        return Ok(());
    }
    Err(ModelError::BadShape {
        name: name.to_string(),
        expected: expected.to_vec(),
        got: got.to_vec(),
    })
}

fn layer_from_store(c: &LlamaConfig, g: &Getter<'_>, l: usize) -> Result<LayerWeights, ModelError> {
    let (h, i, hd) = (c.hidden_size, c.intermediate_size, c.head_dim);
    let (q_out, kv_out) = (c.num_attention_heads * hd, c.num_key_value_heads * hd);
    let p = format!("model.layers.{l}");
    let attn =
        |m: &str, suffix: &str, shape: Vec<usize>| (format!("{p}.self_attn.{m}.{suffix}"), shape);
    let qkv = g.matrix(&[
        attn("q_proj", "weight", vec![q_out, h]),
        attn("k_proj", "weight", vec![kv_out, h]),
        attn("v_proj", "weight", vec![kv_out, h]),
    ])?;
    let qkv_bias = if c.attention_bias {
        Some(g.stacked(&[
            attn("q_proj", "bias", vec![q_out]),
            attn("k_proj", "bias", vec![kv_out]),
            attn("v_proj", "bias", vec![kv_out]),
        ])?)
    } else {
        None
    };
    let (q_norm, k_norm) = if c.qk_norm {
        let (q_len, k_len) = crate::config::qk_norm_lens(c);
        let (qn, qs) = attn("q_norm", "weight", vec![q_len]);
        let (kn, ks) = attn("k_norm", "weight", vec![k_len]);
        (Some(g.get(&qn, &qs)?), Some(g.get(&kn, &ks)?))
    } else {
        (None, None)
    };
    let named = |m: &str, shape: Vec<usize>| (format!("{p}.{m}"), shape);
    let mlp = |m: &str, shape: Vec<usize>| named(&format!("mlp.{m}.weight"), shape);
    let (mut gate_up, mut down) = (Matrix::default(), Matrix::default());
    let (mut router, mut experts, mut shared_gate) = (None, Vec::new(), None);
    match c.sparse_layer(l) {
        None => {
            gate_up = g.matrix(&[mlp("gate_proj", vec![i, h]), mlp("up_proj", vec![i, h])])?;
            down = g.matrix(&[mlp("down_proj", vec![h, i])])?;
        }
        Some(moe) => {
            let (e_i, block) = (moe.expert_intermediate_size, moe.naming.block());
            router = Some(g.matrix(&[named(
                &format!("{block}.gate.weight"),
                vec![moe.num_experts, h],
            )])?);
            for e in 0..moe.num_experts {
                let [gate, up, dn] = moe.naming.expert(e);
                experts.push(ExpertWeights {
                    gate_up: g.matrix(&[named(&gate, vec![e_i, h]), named(&up, vec![e_i, h])])?,
                    down: g.matrix(&[named(&dn, vec![h, e_i])])?,
                });
            }
            if let Some(s_i) = moe.shared_expert_intermediate_size {
                let shared = |m: &str, shape| mlp(&format!("shared_expert.{m}"), shape);
                gate_up = g.matrix(&[
                    shared("gate_proj", vec![s_i, h]),
                    shared("up_proj", vec![s_i, h]),
                ])?;
                down = g.matrix(&[shared("down_proj", vec![h, s_i])])?;
                shared_gate = Some(g.matrix(&[mlp("shared_expert_gate", vec![1, h])])?);
            }
        }
    }
    Ok(LayerWeights {
        input_norm: g.get(&format!("{p}.input_layernorm.weight"), &[h])?,
        qkv,
        qkv_bias,
        q_norm,
        k_norm,
        o_proj: g.matrix(&[attn("o_proj", "weight", vec![h, q_out])])?,
        o_bias: if c.o_proj_bias {
            let (name, shape) = attn("o_proj", "bias", vec![h]);
            Some(g.get(&name, &shape)?)
        } else {
            None
        },
        post_norm: g.get(&format!("{p}.post_attention_layernorm.weight"), &[h])?,
        gate_up,
        down,
        router,
        experts,
        shared_gate,
    })
}
