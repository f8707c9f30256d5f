# GEMSTAGE_KERNELS_ONLY: the rooms below the model code (core, cache, kernels) and their tests
# (tests/kernels_test.cc, tests/quant_test.cc) as one GoogleTest binary, gemstage_kernel_tests.
# This is what the `aarch64` preset cross-builds: it needs no third-party library but GoogleTest,
# which is compiled here from Debian's sources (package googletest, /usr/src/googletest) for the
# target, since Debian ships no arm64 build of it to a cross toolchain. Included from the root
# CMakeLists after GEMSTAGE_WARNINGS is set.
set(GEMSTAGE_ROOMS core cache kernels)
foreach(room IN LISTS GEMSTAGE_ROOMS)
  add_subdirectory(src/${room})
endforeach()
gemstage_check_layers()

if(GEMSTAGE_BUILD_TESTS)
  set(GEMSTAGE_GTEST_SOURCE /usr/src/googletest/googletest CACHE PATH "GoogleTest sources")
  if(NOT EXISTS ${GEMSTAGE_GTEST_SOURCE}/CMakeLists.txt)
    message(FATAL_ERROR "GEMSTAGE_KERNELS_ONLY builds GoogleTest from source and found none at "
                        "${GEMSTAGE_GTEST_SOURCE}: install Debian's googletest package "
                        "(scripts/setup.sh) or set GEMSTAGE_GTEST_SOURCE")
  endif()
  set(INSTALL_GTEST OFF CACHE BOOL "" FORCE)
  add_subdirectory(${GEMSTAGE_GTEST_SOURCE} ${CMAKE_BINARY_DIR}/googletest EXCLUDE_FROM_ALL)
  enable_testing()
  add_executable(gemstage_kernel_tests tests/kernels_test.cc tests/quant_test.cc)
  target_compile_options(gemstage_kernel_tests PRIVATE ${GEMSTAGE_WARNINGS})
  target_link_libraries(gemstage_kernel_tests PRIVATE gemstage_kernels gtest gtest_main)
  set_target_properties(gemstage_kernel_tests PROPERTIES RUNTIME_OUTPUT_DIRECTORY
                                                         ${CMAKE_BINARY_DIR}/tests)
  # One ctest entry for the whole binary (under the cross toolchain's emulator, qemu-aarch64):
  # listing each test case through qemu would cost a start-up per case.
  add_test(NAME kernel_tests COMMAND gemstage_kernel_tests)
  set_tests_properties(kernel_tests PROPERTIES TIMEOUT 600)
  # qemu's default CPU has the dot-product extension, so the run above proves the SDOT kernels;
  # this one emulates a Cortex-A72 (Armv8.0, no dot product: Raspberry Pi 4) to prove the SMULL
  # fallback too. QEMU_CPU only means something to qemu-user.
  if(CMAKE_CROSSCOMPILING_EMULATOR MATCHES "qemu")
    add_test(NAME kernel_tests_armv8_0 COMMAND gemstage_kernel_tests)
    set_tests_properties(kernel_tests_armv8_0 PROPERTIES TIMEOUT 600 ENVIRONMENT QEMU_CPU=cortex-a72)
  endif()
endif()
