#pragma once
// Umbrella header: the user tier (docs/DESIGN.md §8): init_from_env, shard / ShardedModel,
// MuonAdamW, the options, checkpoints, clipping, and what they are built from. The engine tier is
// included by name: FsdpParameterGroup and shard_module, the explicit API's groups
// (<fsdp_muon/fsdp/parameter_group.h>, <fsdp_muon/fsdp/shard_module.h>), Newton–Schulz on its own
// (<fsdp_muon/newton_schulz/newton_schulz.h>), the owner planner
// (<fsdp_muon/planning/owner_plan.h>), FsdpMuon's plan and step statistics
// (<fsdp_muon/optimizer/fsdp_muon_introspection.h>), the backends' factories
// (<fsdp_muon/comm/gloo_communicator.h>, <fsdp_muon/comm/nccl_communicator.h>).

#include <fsdp_muon/config.h>

#include <fsdp_muon/checkpoint/checkpoint.h>
#include <fsdp_muon/comm/communicator.h>
#include <fsdp_muon/comm/device_mesh.h>
#include <fsdp_muon/fsdp/clip_grad_norm.h>
#include <fsdp_muon/fsdp/qk_clip.h>
#include <fsdp_muon/fsdp/sharded_model.h>
#include <fsdp_muon/muon/matrix_layout.h>
#include <fsdp_muon/muon/muon.h>
#include <fsdp_muon/muon/muon_options.h>
#include <fsdp_muon/optimizer/fsdp_muon.h>
#include <fsdp_muon/training/muon_adamw.h>
