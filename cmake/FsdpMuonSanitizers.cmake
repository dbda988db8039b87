# FSDP_MUON_SANITIZE (scripts/test --sanitize): our targets — the library, tests, examples and
# benchmarks — compiled and linked with sanitizers. LibTorch, Gloo and the other libraries stay as
# they are (uninstrumented); scripts/test sets the runtime options and the suppressions
# (scripts/sanitizers/), each justified there. Not for installed builds.
set(FSDP_MUON_SANITIZE "" CACHE STRING
    "Sanitizers for our targets: address,undefined or thread (empty: none)")
if(FSDP_MUON_SANITIZE)
  if(NOT FSDP_MUON_SANITIZE MATCHES "^(address,undefined|address|undefined|thread)$")
    message(FATAL_ERROR "FSDP_MUON_SANITIZE must be address,undefined, address, undefined or "
                        "thread, got '${FSDP_MUON_SANITIZE}'")
  endif()
  add_compile_options(-fsanitize=${FSDP_MUON_SANITIZE} -fno-omit-frame-pointer -g1)
  add_link_options(-fsanitize=${FSDP_MUON_SANITIZE})
  if(FSDP_MUON_SANITIZE MATCHES "undefined")
    # A finding fails the test that hit it instead of scrolling by.
    add_compile_options(-fno-sanitize-recover=undefined)
  endif()
  message(STATUS "fsdp_muon: sanitizers ${FSDP_MUON_SANITIZE} on our targets")
endif()
