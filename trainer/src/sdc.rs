//! The silent-data-corruption check. Every rank of a data-parallel group holds the same
//! dense weights, and every rank of an expert-data-parallel group the same experts, bit for
//! bit: each update all-gathers them from the same master shards. A copy that differs was
//! changed behind the training's back (a flipped bit in memory). The check compares 64 bits
//! of each tensor's blake3 digest across those groups and names the rank whose copy differs
//! from the majority, the tensor and the step.
//!
//! The trainer runs it after a step's backward pass, on the weights its forward and backward
//! used, and before the update: a copy that differs there has spoiled that step's gradient,
//! which is then not applied.

use candle_core::Result;
use rayon::prelude::*;

use crate::dist::{Group, World};
use crate::model::Model;
use crate::optim::{is_expert, AdamW};

/// Copies of one replicated tensor that differ.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Mismatch {
    /// The world rank whose copy differs from the majority; `None` when no majority names
    /// one (two copies that differ, or several that differ).
    pub suspect: Option<usize>,
    /// The tensor, as the rank that found the mismatch names it.
    pub tensor: String,
    /// How many ranks hold a copy of it.
    pub copies: usize,
}

impl Mismatch {
    /// What an operator reads: which copy, of what, at which step.
    pub fn describe(&self, step: u64) -> String {
        match self.suspect {
            Some(rank) => format!(
                "silent data corruption: rank {rank}'s copy of {} differs from the other {} copies in the weights step {step} computed with",
                self.tensor,
                self.copies - 1
            ),
            None => format!(
                "silent data corruption: the {} copies of {} differ in the weights step {step} computed with, and no majority names the bad one",
                self.copies, self.tensor
            ),
        }
    }
}

/// 64 bits of the blake3 digest of each of this rank's parameters as the model holds them,
/// in the optimizer's placement order (dense parameters, then this rank's experts).
pub fn digests(model: &Model, optim: &AdamW) -> Result<Vec<u64>> {
    let parameters = model.parameters();
    optim
        .placements
        .par_iter()
        .map(|placement| {
            let values: Vec<f32> = parameters[placement.index].1.flatten_all()?.to_vec1()?;
            let digest = blake3::hash(bytemuck::cast_slice(&values));
            let mut first = [0u8; 8];
            first.copy_from_slice(&digest.as_bytes()[..8]);
            Ok(u64::from_le_bytes(first))
        })
        .collect()
}

/// The first tensor whose copies differ in `gathered` (each of `members` ranks' digests in
/// turn, the same count each), with the member whose copy alone differs from a strict
/// majority, if one does.
pub fn compare(gathered: &[u64], members: usize) -> Option<(usize, Option<usize>)> {
    let tensors = gathered.len() / members.max(1);
    (0..tensors).find_map(|tensor| {
        let copies: Vec<u64> = (0..members)
            .map(|m| gathered[m * tensors + tensor])
            .collect();
        if copies.iter().all(|c| *c == copies[0]) {
            return None;
        }
        let majority = copies
            .iter()
            .find(|c| 2 * copies.iter().filter(|o| o == c).count() > members);
        let suspect = majority.and_then(|majority| {
            let differing: Vec<usize> = (0..members).filter(|&m| copies[m] != *majority).collect();
            (differing.len() == 1).then_some(differing[0])
        });
        Some((tensor, suspect))
    })
}

/// Bytes of a tensor name passed from the rank that found a mismatch to every other rank.
const NAME_BYTES: usize = 128;

/// Compares every replicated tensor across the ranks that hold it. Collective over the
/// world: every rank gets the same answer.
pub fn check(world: &World, model: &Model, optim: &AdamW) -> Result<Option<Mismatch>> {
    let digests = digests(model, optim)?;
    // This rank's finding in its own groups: (placement, suspect world rank, copies).
    let mut found: Option<(usize, Option<usize>, usize)> = None;
    for (group, expert) in [(Group::Data, false), (Group::ExpertData, true)] {
        let indices: Vec<usize> = (0..optim.placements.len())
            .filter(|&i| is_expert(&optim.placements[i].name) == expert)
            .collect();
        let mine: Vec<u64> = indices.iter().map(|&i| digests[i]).collect();
        let members = world.members(group);
        let gathered = world.all_gather_u64(group, &mine);
        if found.is_none() {
            found = compare(&gathered, members.len()).map(|(tensor, suspect)| {
                (indices[tensor], suspect.map(|m| members[m]), members.len())
            });
        }
    }
    // Every rank learns the finding of the lowest rank that has one.
    let local = match found {
        Some((placement, suspect, copies)) => [
            1,
            suspect.map_or(0, |s| s as u64 + 1),
            placement as u64,
            copies as u64,
        ],
        None => [0; 4],
    };
    let all = world.all_gather_u64(Group::World, &local);
    let Some(finder) = all.chunks(4).position(|r| r[0] == 1) else {
        return Ok(None);
    };
    let report = &all[finder * 4..finder * 4 + 4];
    let mut name = [0u8; NAME_BYTES];
    if world.rank == finder {
        let own = optim.placements[report[2] as usize].name.as_bytes();
        let len = own.len().min(NAME_BYTES);
        name[..len].copy_from_slice(&own[..len]);
    }
    let words: Vec<u64> = name.iter().map(|b| u64::from(*b)).collect();
    let name: Vec<u8> = world
        .sum_u64(Group::World, &words)
        .into_iter()
        .map(|b| b as u8)
        .take_while(|b| *b != 0)
        .collect();
    Ok(Some(Mismatch {
        suspect: (report[1] > 0).then(|| report[1] as usize - 1),
        tensor: String::from_utf8_lossy(&name).into_owned(),
        copies: report[3] as usize,
    }))
}

/// Flips one bit of this rank's copy of its first replicated weight (the test fault
/// `test_faults.flip_after_step`): what a bad memory cell does.
pub fn flip_one_bit(model: &Model, optim: &AdamW) -> Result<String> {
    let placement = &optim.placements[0];
    let var = model.parameters()[placement.index].1;
    let mut values: Vec<f32> = var.flatten_all()?.to_vec1()?;
    values[0] = f32::from_bits(values[0].to_bits() ^ (1 << 22));
    var.set(&candle_core::Tensor::from_slice(
        &values,
        placement.shape.as_slice(),
        &model.device,
    )?)?;
    Ok(placement.name.clone())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn copies_that_agree_name_nothing() {
        assert_eq!(compare(&[1, 2, 1, 2, 1, 2], 3), None);
        assert_eq!(compare(&[7, 8], 1), None);
    }

    #[test]
    fn the_copy_that_differs_from_the_majority_is_named_with_its_tensor() {
        // Three ranks, two tensors each: rank 2's second tensor differs.
        assert_eq!(compare(&[1, 2, 1, 2, 1, 9], 3), Some((1, Some(2))));
        // The first differing tensor is reported.
        assert_eq!(compare(&[5, 2, 1, 2, 1, 9], 3), Some((0, Some(0))));
    }

    #[test]
    fn without_a_majority_a_mismatch_names_no_rank() {
        assert_eq!(compare(&[1, 2], 2), Some((0, None)));
        // Two of four differ, each its own way: no single suspect.
        assert_eq!(compare(&[1, 1, 2, 3], 4), Some((0, None)));
        // Two against two.
        assert_eq!(compare(&[1, 1, 2, 2], 4), Some((0, None)));
    }

    #[test]
    fn a_flipped_bit_changes_the_digest_of_that_tensor_only() {
        let mut config = crate::config::Config::load("tiny", &[]).unwrap();
        config.model = crate::model::tests::small_config(1, 1);
        let model = Model::new(&config.model, 1, candle_core::DType::F32).unwrap();
        let optim =
            AdamW::new(&model, &config.train, std::sync::Arc::new(World::single())).unwrap();
        let before = digests(&model, &optim).unwrap();
        assert_eq!(before, digests(&model, &optim).unwrap(), "deterministic");
        flip_one_bit(&model, &optim).unwrap();
        let after = digests(&model, &optim).unwrap();
        assert_ne!(before[0], after[0]);
        assert_eq!(before[1..], after[1..]);
        let gathered: Vec<u64> = [before.clone(), after, before].concat();
        assert_eq!(compare(&gathered, 3), Some((0, Some(1))));
    }
}
