#pragma once
// Umbrella header: every public header of fsdp_muon.

#include <fsdp_muon/config.h>

#include <fsdp_muon/checkpoint/checkpoint.h>
#include <fsdp_muon/comm/communicator.h>
#include <fsdp_muon/comm/device_mesh.h>
#include <fsdp_muon/comm/gloo_communicator.h>
#include <fsdp_muon/comm/nccl_communicator.h>
#include <fsdp_muon/fsdp/parameter_group.h>
#include <fsdp_muon/fsdp/shard_module.h>
#include <fsdp_muon/fsdp/sharded_model.h>
#include <fsdp_muon/muon/matrix_layout.h>
#include <fsdp_muon/muon/muon.h>
#include <fsdp_muon/muon/muon_options.h>
#include <fsdp_muon/newton_schulz/newton_schulz.h>
#include <fsdp_muon/optimizer/clip_grad_norm.h>
#include <fsdp_muon/optimizer/fsdp_muon.h>
#include <fsdp_muon/optimizer/owner_plan.h>
#include <fsdp_muon/optimizer/qk_clip.h>
#include <fsdp_muon/training/muon_adamw.h>
