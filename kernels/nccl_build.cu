// This NCCL build's table (kernels/nccl_builds.txt): the only symbol of the build that stays
// global once build.rs has linked its objects together and made the rest local, so the builds'
// identical names (kernels, launchers, NCCL's inline functions) never resolve across builds.
// build.rs defines DEEPEP_NCCL_SERVES_BELOW.
#include <nccl.h>
#include <nccl_device.h>

#include "deepep_kernels.h"
#include "launch.cuh"
#include "ll_common.cuh"

#ifndef DEEPEP_NCCL_SERVES_BELOW
#error "build.rs defines DEEPEP_NCCL_SERVES_BELOW (kernels/nccl_builds.txt)"
#endif

// Every launcher's kernel table (each launcher's translation unit loads its own), then the
// layout kernels. A new launcher file adds its preload_*_kernels here.
extern "C" int deepep_preload_kernels(void) {
  using namespace deepep;
  constexpr cudaError_t (*kPreloads[])() = {
      preload_transport_kernels,        preload_normal_notify_kernels,    preload_normal_dispatch_kernels,
      preload_normal_combine_kernels,   preload_ll_dispatch_kernels,      preload_ll_combine_kernels,
      preload_ll_control_kernels,       preload_internode_notify_kernels, preload_internode_dispatch_kernels,
      preload_internode_combine_kernels,
  };
  for (const auto preload : kPreloads) {
    const cudaError_t rc = preload();
    if (rc != cudaSuccess) return int(rc);
  }
  return deepep_preload_layout_kernels();
}

extern "C" __attribute__((visibility("default"))) const DeepepNcclBuild* DEEPEP_NCCL_BUILD_FN(NCCL_VERSION_CODE)(void) {
  static const DeepepNcclBuild build = [] {
    DeepepNcclBuild b{};
    b.nccl_version = NCCL_VERSION_CODE;
    b.serves_below = DEEPEP_NCCL_SERVES_BELOW;
    b.gin_compiled = DEEPEP_HAVE_GIN;
    b.devcomm_size = sizeof(ncclDevComm);
    b.devcomm_requirements_size = sizeof(ncclDevCommRequirements);
    b.devcomm_requirements_init = deepep_devcomm_requirements_init;
    b.devcomm_info = deepep_devcomm_info;
    b.launch_lsa_barrier = deepep_launch_lsa_barrier;
    b.launch_lsa_peer_check = deepep_launch_lsa_peer_check;
    b.launch_window_geometry = deepep_launch_window_geometry;
    b.launch_normal_notify = deepep_launch_normal_notify;
    b.launch_normal_dispatch = deepep_launch_normal_dispatch;
    b.launch_normal_combine = deepep_launch_normal_combine;
    b.launch_ll_dispatch = deepep_launch_ll_dispatch;
    b.launch_ll_combine = deepep_launch_ll_combine;
    b.launch_ll_clean = deepep_launch_ll_clean;
    b.launch_internode_notify = deepep_launch_internode_notify;
    b.launch_internode_dispatch = deepep_launch_internode_dispatch;
    b.launch_internode_combine = deepep_launch_internode_combine;
    b.preload_kernels = deepep_preload_kernels;
    return b;
  }();
  return &build;
}
