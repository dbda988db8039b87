#pragma once
// Umbrella header: everything a training program needs from fsdp_muon.

#include <fsdp_muon/config.h>

#include <fsdp_muon/checkpoint/checkpoint.h>
#include <fsdp_muon/comm/communicator.h>
#include <fsdp_muon/fsdp/parameter_group.h>
#include <fsdp_muon/fsdp/shard_module.h>
#include <fsdp_muon/muon/muon.h>
#include <fsdp_muon/muon/muon_options.h>
#include <fsdp_muon/newton_schulz/newton_schulz.h>
#include <fsdp_muon/optimizer/fsdp_muon.h>
#include <fsdp_muon/optimizer/owner_plan.h>
