# The tests of a cross build (the `aarch64` preset), run under the toolchain's emulator
# (qemu-aarch64). Included from tests/CMakeLists.txt after gemstage_tests and the node tests are
# declared. Instead of one ctest entry per test case (each a qemu start-up of the whole binary)
# the cases run in a few groups, each one test process with a --gtest_filter (the `ci` groups run
# gemstage_ci_tests, the sources of their suites only; tests/CMakeLists.txt):
#
#   label `ci` (the test preset `aarch64`, scripts/test.sh):
#     kernels_<cpu>  the kernel tests (every tier the emulated CPU has against its scalar twin, on
#                    odd sizes) on three CPU models: cortex-a72 (Armv8.0, no dot product: the
#                    Raspberry Pi 4 class), neoverse-n1 (Armv8.2 with SDOT: Graviton 2, Ampere
#                    Altra) and max (every extension qemu knows, i8mm included).
#     golden         every golden-fixture parity test: the E-series text, image and audio
#                    fixtures, MoE, dense, the 12B unified model and the drafter, each within its
#                    manifest tolerance with exact greedy ids; the CLI's `dump` of each fixture
#                    set against its goldens; `generate`'s greedy ids against `dump`'s; a chat
#                    completion answered by the server.
#   label `full` (scripts/test_aarch64_full.sh): the whole of gemstage_tests in shards, the golden
#                    group again on each lower tier (scalar, neon, dotprod), and the node tests
#                    (serve, tokenizer parity).
#
# QEMU_CPU picks the emulated CPU of qemu-user; the CLI, started by the tests through
# build-aarch64/gemstage-emulated, inherits it.
if(NOT CMAKE_CROSSCOMPILING_EMULATOR)
  message(STATUS "gemstage: no emulator for the ${CMAKE_SYSTEM_PROCESSOR} tests (install "
                 "qemu-user); they are built but not registered with ctest")
  return()
endif()

set(GEMSTAGE_KERNEL_TEST_FILTER
    "*MatmulOdd*:Dtype.*:RmsNorm.*:Gelu.*:Softcap.*:Rope.*:Attention.*:*VectorOps*:ThreadPool.*:QuantLayout.*:*QuantRoundTrip*:QuantReaders.*:*QuantMatmul*")
set(GEMSTAGE_GOLDEN_TEST_FILTER
    "*TextParity*:TextDecode.*:*VisionFixture*:*MultimodalFixture*:DumpCli.*:AudioFeatures.MatchTheFixtureWithinTolerance:AudioTowerFixture.EveryTapWithinTheManifestTolerance:AudioFixture.*:AudioCli.DumpWritesTheFixtureTapsAndInfoListsTheTower:*UnifiedParity*:UnifiedBf16.*:UnifiedCli.DumpImageAndAudioGreedyIds:*LargeMultimodal*:Experts.*:*DraftFixture*:QuantModel.*:Generate.GreedyEqualsDumpGreedyDecode:AudioServe.ChatCompletionWithInputAudioEqualsGenerateAudio:ParityCli.DefaultModelPassesTightGatesOn*")

foreach(cpu cortex-a72 neoverse-n1 max)
  add_test(NAME kernels_${cpu}
           COMMAND gemstage_ci_tests --gtest_filter=${GEMSTAGE_KERNEL_TEST_FILTER})
  set_tests_properties(kernels_${cpu} PROPERTIES LABELS ci TIMEOUT 1800
                       ENVIRONMENT QEMU_CPU=${cpu})
endforeach()
add_test(NAME golden COMMAND gemstage_ci_tests --gtest_filter=${GEMSTAGE_GOLDEN_TEST_FILTER})
set_tests_properties(golden PROPERTIES LABELS ci TIMEOUT 3600 ENVIRONMENT QEMU_CPU=max)

# `gemstage parity` of every fixture set's model against the set's reference dumps: each tap
# within its manifest tolerance (no first divergence) and every teacher-forced greedy step equal.
# The image comes from the set's PNG and the audio from its WAV through our own decoders.
set(GEMSTAGE_FIXTURE_SETS
    gemma4-tiny/text gemma4-tiny/multimodal gemma4-tiny/long
    gemma4-tiny-moe/text gemma4-tiny-moe/multimodal gemma4-tiny-moe/long
    gemma4-tiny-dense/text gemma4-tiny-dense/multimodal gemma4-tiny-dense/long
    gemma4-tiny-audio/audio
    gemma4-tiny-unified/text gemma4-tiny-unified/image gemma4-tiny-unified/audio
    gemma4-tiny-unified/long)
foreach(set IN LISTS GEMSTAGE_FIXTURE_SETS)
  get_filename_component(family ${set} DIRECTORY)
  string(REPLACE "/" "_" name ${set})
  add_test(NAME parity_${name}
           COMMAND ${GEMSTAGE_CLI_COMMAND} parity -t 2
                   --model ${PROJECT_SOURCE_DIR}/tests/fixtures/${family}/model
                   --reference ${PROJECT_SOURCE_DIR}/tests/fixtures/${set}
                   --gate first_divergence.found==0 --gate teacher_forced>=1.0)
  set_tests_properties(parity_${name} PROPERTIES LABELS ci TIMEOUT 900 ENVIRONMENT QEMU_CPU=max)
endforeach()

# The whole binary, split by GoogleTest's sharding so ctest -j can run the parts side by side.
set(GEMSTAGE_EMULATED_SHARDS 4)
math(EXPR last_shard "${GEMSTAGE_EMULATED_SHARDS} - 1")
foreach(shard RANGE ${last_shard})
  add_test(NAME all_tests_${shard} COMMAND gemstage_tests)
  set_tests_properties(all_tests_${shard} PROPERTIES LABELS full TIMEOUT 7200 ENVIRONMENT
    "QEMU_CPU=max;GTEST_TOTAL_SHARDS=${GEMSTAGE_EMULATED_SHARDS};GTEST_SHARD_INDEX=${shard}")
endforeach()
# The golden group on the lower tiers (the best one, i8mm on `max`, ran above).
foreach(tier scalar neon dotprod)
  add_test(NAME golden_isa_${tier} COMMAND gemstage_tests --gtest_filter=${GEMSTAGE_GOLDEN_TEST_FILTER})
  set_tests_properties(golden_isa_${tier} PROPERTIES LABELS full TIMEOUT 3600
                       ENVIRONMENT "QEMU_CPU=max;GEMSTAGE_ISA=${tier}")
endforeach()
# The node tests, declared for every build in tests/CMakeLists.txt, start the CLI through the
# emulator; their waits stretch as in the sanitizer build.
set_tests_properties(tokenizer_npm_parity serve_openai_client serve_anthropic_client
                     serve_responses_client serve_load serve_chat_page serve_chat_page_audio
                     serve_soak PROPERTIES LABELS full)
set_tests_properties(serve_openai_client serve_anthropic_client serve_responses_client serve_load
                     serve_chat_page serve_chat_page_audio serve_soak PROPERTIES
                     ENVIRONMENT "GEMSTAGE_SANITIZED=1;QEMU_CPU=max")
