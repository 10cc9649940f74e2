use super::k3::*;
use super::spec::*;
use deltafin_tensor::mxfp4;

#[test]
fn scaled_config_pattern() {
    let c = scaled_config(&SynthDims::tiny()).unwrap();
    assert_eq!(c.text.linear_attn.full_attn_layers, vec![4, 8, 12, 14]);
    assert_eq!(c.text.linear_attn.kda_layers.len(), 10);
    let v = c.to_json_value();
    assert_eq!(v["text_config"]["top_k"], 50);
    assert_eq!(v["vision_config"]["vt_hidden_size"], 16);
}

#[test]
fn scale_base_matches_std() {
    // Empirical std of random codes with the chosen scales is within a factor √2.
    let std = 1.0 / 32f32.sqrt();
    let base = scale_base(std);
    let mut rng = SplitMix64::new(1);
    let (mut s2, n) = (0f64, 32 * 2000);
    for _ in 0..n / 32 {
        let e = base - 1 + (rng.next_u64() % 3) as u8;
        let sc = mxfp4::e8m0_scale(e).unwrap();
        for _ in 0..32 {
            let v = mxfp4::E2M1[(rng.next_u64() % 16) as usize] * sc;
            s2 += (v * v) as f64;
        }
    }
    let got = (s2 / n as f64).sqrt() as f32;
    assert!(
        got > std / 2f32.sqrt() && got < std * 2f32.sqrt(),
        "{got} vs {std}"
    );
}

#[test]
fn stream_exceeds_ram() {
    let ram = 8u64 << 30;
    let d = SynthDims::stream(ram);
    let experts = (d.layers - 1) as u64 * d.experts as u64 * d.expert_bytes() as u64;
    assert!(experts > ram, "{experts}");
    assert!(d.experts.is_multiple_of(8));
}

#[test]
fn small_vocab_shifts_special_ids() {
    let mut d = SynthDims::tiny();
    d.vocab = 1024;
    let c = scaled_config(&d).unwrap();
    assert_eq!(c.eos_token_id, 1024 - 256 + 2);
    assert_eq!(c.pad_token_id, 1023);
}

#[test]
fn real_experts_preset_has_the_real_expert_geometry() {
    let d = SynthDims::real_experts();
    assert_eq!(d.expert_bytes(), 17_547_264);
    assert_eq!((d.hidden, d.experts, d.top_k), (7168, 896, 16));
    assert_eq!(d.layers - 1, 1, "one MoE layer");
}
