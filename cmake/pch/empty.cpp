// The translation unit each precompiled header is built with (cmake/FsdpMuonBuildSpeed.cmake).
