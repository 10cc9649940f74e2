//! The op shapes: the inputs of the KDA and MLA kernels, the checks of their lengths against
//! the shapes and the kernels' index type, and their CPU references.

use deltafin_tensor::bf16;

/// Shapes of one MLA absorbed decode (docs/K3.md §4.4).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MlaShape {
    /// Heads `H`.
    pub heads: usize,
    /// `qk_nope_head_dim`.
    pub nope: usize,
    /// `qk_rope_head_dim`.
    pub rope: usize,
    /// `v_head_dim`.
    pub v: usize,
    /// `kv_lora_rank`.
    pub kvl: usize,
}

impl MlaShape {
    /// The softmax scale `1/√(nope + rope)`.
    pub fn scale(&self) -> f32 {
        1.0 / ((self.nope + self.rope) as f32).sqrt()
    }
}

/// Inputs that disagree with their shapes, or a size beyond the kernels' 32-bit indices.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{kernel}: {detail}")]
pub struct ShapeError {
    /// The kernel.
    pub kernel: &'static str,
    /// What disagrees.
    pub detail: String,
}

/// `Ok` when `what` has the `want` values it should, else the error naming both counts.
pub(crate) fn expect_len(
    kernel: &'static str,
    what: &str,
    got: usize,
    want: usize,
) -> Result<(), ShapeError> {
    if got == want {
        return Ok(());
    }
    Err(ShapeError {
        kernel,
        detail: format!("{what} has {got} values, expected {want}"),
    })
}

/// `v` in the kernels' index type `I` (`i32` for CUDA, `u32` for Metal), else the error naming
/// `what`.
pub(crate) fn index<I: TryFrom<usize>>(
    kernel: &'static str,
    what: &str,
    v: usize,
) -> Result<I, ShapeError> {
    I::try_from(v).map_err(|_| ShapeError {
        kernel,
        detail: format!("{what} = {v} exceeds the kernels' 32-bit index range"),
    })
}

/// One KDA recurrent step's inputs for `heads` heads of `d` (`kda.cu`, `kda.metal`; the
/// state, `[heads, d, d]`, is passed beside them and updated in place).
#[derive(Clone, Copy, Debug)]
pub struct KdaStep<'a> {
    /// Heads.
    pub heads: usize,
    /// Queries `[heads, d]`.
    pub q: &'a [f32],
    /// Keys `[heads, d]`.
    pub k: &'a [f32],
    /// Values `[heads, d]`.
    pub v: &'a [f32],
    /// Log-decays `[heads, d]`.
    pub g: &'a [f32],
    /// Write strengths `[heads]`.
    pub beta: &'a [f32],
    /// Head dimension.
    pub d: usize,
}

impl KdaStep<'_> {
    /// Every length against the shapes (`state`: the state's length) and the sizes the kernel
    /// indexes in `I`; `d` as `I`.
    pub(crate) fn check<I: TryFrom<usize>>(&self, state: usize) -> Result<I, ShapeError> {
        const K: &str = "kda_step";
        let (heads, d) = (self.heads, self.d);
        expect_len(K, "state", state, heads * d * d)?;
        for (name, x) in [("q", self.q), ("k", self.k), ("v", self.v), ("g", self.g)] {
            expect_len(K, name, x.len(), heads * d)?;
        }
        expect_len(K, "beta", self.beta.len(), heads)?;
        index::<I>(K, "heads·d·d", heads * d * d)?;
        index(K, "d", d)
    }

    /// The step by the CPU reference (`reference::kda_step`, head by head) from `state`,
    /// which it updates; the outputs.
    pub fn reference(&self, state: &mut [f32]) -> Vec<f32> {
        let d = self.d;
        let mut out = Vec::with_capacity(self.heads * d);
        for (h, s) in state.chunks_exact_mut(d * d).enumerate() {
            let sl = h * d..(h + 1) * d;
            out.extend(crate::reference::kda_step(
                s,
                &self.q[sl.clone()],
                &self.k[sl.clone()],
                &self.v[sl.clone()],
                &self.g[sl],
                self.beta[h],
            ));
        }
        out
    }
}

/// One absorbed MLA decode's inputs over `tokens` cached tokens (`mla.cu`, `mla.metal`).
#[derive(Clone, Copy, Debug)]
pub struct MlaDecode<'a> {
    /// The shapes.
    pub shape: MlaShape,
    /// The query `[heads, nope + rope]`.
    pub q: &'a [f32],
    /// `kv_b_proj` `[heads · (nope + v), kv_lora]`.
    pub kv_b: &'a [bf16],
    /// Cached tokens attended to (at least one).
    pub tokens: usize,
    /// The latent cache `[tokens, kv_lora]`.
    pub latent: &'a [bf16],
    /// The rope tail cache `[tokens, rope]`.
    pub tail: &'a [bf16],
    /// The output gate `[heads, v]`.
    pub gate: &'a [f32],
}

impl MlaDecode<'_> {
    /// Every length against the shapes and the sizes the kernel indexes in `I`.
    pub(crate) fn check<I: TryFrom<usize>>(&self) -> Result<(), ShapeError> {
        const K: &str = "mla_decode";
        let MlaShape {
            heads,
            nope,
            rope,
            v,
            kvl,
        } = self.shape;
        let n = self.tokens;
        if n == 0 {
            return Err(ShapeError {
                kernel: K,
                detail: "no cached tokens to attend to".into(),
            });
        }
        expect_len(K, "q", self.q.len(), heads * (nope + rope))?;
        expect_len(K, "kv_b_proj", self.kv_b.len(), heads * (nope + v) * kvl)?;
        expect_len(K, "latent cache", self.latent.len(), n * kvl)?;
        expect_len(K, "tail cache", self.tail.len(), n * rope)?;
        expect_len(K, "gate", self.gate.len(), heads * v)?;
        index::<I>(K, "kv_b_proj values", self.kv_b.len())?;
        index::<I>(K, "cache values", n * kvl)?;
        index::<I>(K, "scores", heads * n)?;
        Ok(())
    }

    /// The decode by the CPU reference (`reference::mla_decode`).
    pub fn reference(&self) -> Vec<f32> {
        let s = self.shape;
        crate::reference::mla_decode(
            (s.heads, s.nope, s.rope, s.v, s.kvl),
            self.tokens,
            self.q,
            self.kv_b,
            self.latent,
            self.tail,
            self.gate,
        )
    }
}
