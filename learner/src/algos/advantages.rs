//! Group-relative advantages (GRPO, Shao et al. 2024, §4.1.2; TRL `scale_rewards`).

use serde::{Deserialize, Serialize};

/// How rewards are scaled after subtracting the group mean.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ScaleRewards {
    /// A = (R − mean_group) / (std_group + 1e-4).
    Group,
    /// A = (R − mean_group) / (std_batch + 1e-4).
    Batch,
    /// A = R − mean_group (Dr. GRPO).
    None,
}

/// Advantages and group statistics.
#[derive(Debug, Clone, PartialEq)]
pub struct Advantages {
    pub advantages: Vec<f32>,
    /// Groups whose rewards are all equal (zero advantage), as a fraction of groups.
    pub frac_reward_zero_std: f64,
    /// Per sample: false when its group has zero std and `filter_zero_std_groups` is set.
    pub keep: Vec<bool>,
    pub reward_mean: f64,
    pub reward_std: f64,
}

/// Unbiased standard deviation (as `torch.std`), 0 for fewer than two values.
fn std(v: &[f64]) -> f64 {
    if v.len() < 2 {
        return 0.0;
    }
    let m = v.iter().sum::<f64>() / v.len() as f64;
    (v.iter().map(|x| (x - m) * (x - m)).sum::<f64>() / (v.len() - 1) as f64).sqrt()
}

/// Advantages of `rewards`, grouped by `groups` (same id = samples of one prompt). Never
/// NaN: a group of one or of equal rewards gets advantage 0.
pub fn compute_advantages(
    rewards: &[f32],
    groups: &[u64],
    scale: ScaleRewards,
    filter_zero_std_groups: bool,
) -> Advantages {
    assert_eq!(rewards.len(), groups.len());
    let mut members: std::collections::BTreeMap<u64, Vec<usize>> = Default::default();
    for (i, g) in groups.iter().enumerate() {
        members.entry(*g).or_default().push(i);
    }
    let all: Vec<f64> = rewards.iter().map(|&r| r as f64).collect();
    let batch_std = std(&all);
    let mut adv = vec![0.0f32; rewards.len()];
    let mut keep = vec![true; rewards.len()];
    let mut zero_std_groups = 0;
    for idx in members.values() {
        let r: Vec<f64> = idx.iter().map(|&i| all[i]).collect();
        let mean = r.iter().sum::<f64>() / r.len() as f64;
        let gstd = std(&r);
        let zero = r.iter().all(|&x| x == r[0]);
        if zero {
            zero_std_groups += 1;
        }
        for (&i, &ri) in idx.iter().zip(&r) {
            let a = match scale {
                ScaleRewards::Group => (ri - mean) / (gstd + 1e-4),
                ScaleRewards::Batch => (ri - mean) / (batch_std + 1e-4),
                ScaleRewards::None => ri - mean,
            };
            adv[i] = if zero { 0.0 } else { a as f32 };
            keep[i] = !(zero && filter_zero_std_groups);
        }
    }
    let mean = all.iter().sum::<f64>() / all.len().max(1) as f64;
    Advantages {
        advantages: adv,
        frac_reward_zero_std: zero_std_groups as f64 / members.len().max(1) as f64,
        keep,
        reward_mean: mean,
        reward_std: batch_std,
    }
}
