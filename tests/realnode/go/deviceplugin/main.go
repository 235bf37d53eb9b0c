// deviceplugin: a kubelet device plugin (deviceplugin/v1beta1) for the real-node tests. It advertises the
// fake NVML's GPUs (the JSON state file libnvidia-ml's fake reads, $FAKE_NVML_STATE) as nvidia.com/gpu the
// way NVIDIA's k8s-device-plugin names them: a GPU's UUID; with MIG on, its MIG devices' UUIDs instead
// (the "single" strategy); with -replicas N (time-slicing) each ID N times as "<id>::<n>". A GPU the state
// marks lost, or whose every call fails ("fail_all"), is reported Unhealthy, as the real plugin does when
// NVML reports it gone. The state is re-read when it changes; the plugin re-registers when the kubelet
// restarts (the kubelet removes every socket in the device-plugin directory when it starts).
package main

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"log"
	"net"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	pluginapi "k8s.io/kubelet/pkg/apis/deviceplugin/v1beta1"
)

type gpuState struct {
	UUID       string   `json:"uuid"`
	MigMode    int      `json:"mig_mode"`
	MigDevices []string `json:"mig_devices"`
	Lost       bool     `json:"lost"`
	FailAll    int      `json:"fail_all"`
}

type plugin struct {
	pluginapi.UnimplementedDevicePluginServer
	state    string
	replicas int
	mu       sync.Mutex
	devices  []*pluginapi.Device
	changed  chan struct{}
}

func (p *plugin) read() ([]*pluginapi.Device, error) {
	data, err := os.ReadFile(p.state)
	if err != nil {
		return nil, err
	}
	var state struct {
		GPUs []gpuState `json:"gpus"`
	}
	if err := json.Unmarshal(data, &state); err != nil {
		return nil, err
	}
	var devices []*pluginapi.Device
	for _, gpu := range state.GPUs {
		health := pluginapi.Healthy
		if gpu.Lost || gpu.FailAll != 0 {
			health = pluginapi.Unhealthy
		}
		ids := []string{gpu.UUID}
		if gpu.MigMode != 0 && len(gpu.MigDevices) > 0 {
			ids = gpu.MigDevices
		}
		for _, id := range ids {
			if p.replicas <= 1 {
				devices = append(devices, &pluginapi.Device{ID: id, Health: health})
				continue
			}
			for n := 0; n < p.replicas; n++ {
				devices = append(devices, &pluginapi.Device{ID: fmt.Sprintf("%s::%d", id, n), Health: health})
			}
		}
	}
	return devices, nil
}

func (p *plugin) watch() {
	for {
		if devices, err := p.read(); err != nil {
			log.Printf("reading %s: %v", p.state, err)
		} else {
			p.mu.Lock()
			if describe(devices) != describe(p.devices) {
				p.devices = devices
				close(p.changed)
				p.changed = make(chan struct{})
				log.Printf("devices: %s", describe(devices))
			}
			p.mu.Unlock()
		}
		time.Sleep(200 * time.Millisecond)
	}
}

func describe(devices []*pluginapi.Device) string {
	parts := make([]string, 0, len(devices))
	for _, d := range devices {
		parts = append(parts, d.ID+"="+d.Health)
	}
	return strings.Join(parts, " ")
}

func (p *plugin) GetDevicePluginOptions(context.Context, *pluginapi.Empty) (*pluginapi.DevicePluginOptions, error) {
	return &pluginapi.DevicePluginOptions{}, nil
}

func (p *plugin) ListAndWatch(_ *pluginapi.Empty, stream grpc.ServerStreamingServer[pluginapi.ListAndWatchResponse]) error {
	for {
		p.mu.Lock()
		devices, changed := p.devices, p.changed
		p.mu.Unlock()
		if err := stream.Send(&pluginapi.ListAndWatchResponse{Devices: devices}); err != nil {
			return err
		}
		select {
		case <-changed:
		case <-stream.Context().Done():
			return nil
		}
	}
}

// Allocate answers as NVIDIA's plugin does with its default strategy: the devices named in the container's
// NVIDIA_VISIBLE_DEVICES (for the NVIDIA container runtime, absent here).
func (p *plugin) Allocate(_ context.Context, request *pluginapi.AllocateRequest) (*pluginapi.AllocateResponse, error) {
	response := &pluginapi.AllocateResponse{}
	for _, container := range request.ContainerRequests {
		response.ContainerResponses = append(response.ContainerResponses, &pluginapi.ContainerAllocateResponse{
			Envs: map[string]string{"NVIDIA_VISIBLE_DEVICES": strings.Join(container.DevicesIds, ",")},
		})
	}
	return response, nil
}

func (p *plugin) PreStartContainer(context.Context, *pluginapi.PreStartContainerRequest) (*pluginapi.PreStartContainerResponse, error) {
	return &pluginapi.PreStartContainerResponse{}, nil
}

func serve(p *plugin, socket string) (*grpc.Server, error) {
	_ = os.Remove(socket)
	listener, err := net.Listen("unix", socket)
	if err != nil {
		return nil, err
	}
	server := grpc.NewServer()
	pluginapi.RegisterDevicePluginServer(server, p)
	go func() { _ = server.Serve(listener) }()
	return server, nil
}

func register(dir, endpoint, resource string) error {
	conn, err := grpc.NewClient("unix://"+filepath.Join(dir, "kubelet.sock"),
		grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		return err
	}
	defer conn.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	_, err = pluginapi.NewRegistrationClient(conn).Register(ctx, &pluginapi.RegisterRequest{
		Version: pluginapi.Version, Endpoint: endpoint, ResourceName: resource,
		Options: &pluginapi.DevicePluginOptions{}})
	return err
}

func main() {
	state := flag.String("state", os.Getenv("FAKE_NVML_STATE"), "the fake NVML's JSON state file")
	dir := flag.String("dir", pluginapi.DevicePluginPath, "the kubelet's device-plugin directory")
	resource := flag.String("resource", "nvidia.com/gpu", "the extended resource to advertise")
	replicas := flag.Int("replicas", 1, "time-slicing: how many times to advertise each device")
	flag.Parse()
	p := &plugin{state: *state, replicas: *replicas, changed: make(chan struct{})}
	devices, err := p.read()
	if err != nil {
		log.Fatalf("reading %s: %v", *state, err)
	}
	p.devices = devices
	log.Printf("devices: %s", describe(devices))
	go p.watch()
	endpoint := "fake-nvidia-gpu.sock"
	socket := filepath.Join(*dir, endpoint)
	for {
		server, err := serve(p, socket)
		if err != nil {
			log.Fatalf("listening on %s: %v", socket, err)
		}
		for register(*dir, endpoint, *resource) != nil {
			time.Sleep(200 * time.Millisecond)
		}
		log.Printf("registered %s as %s", socket, *resource)
		// The kubelet deletes the directory's sockets when it (re)starts: then serve and register again.
		for {
			time.Sleep(200 * time.Millisecond)
			if _, err := os.Stat(socket); err != nil {
				break
			}
		}
		log.Printf("%s removed (the kubelet restarted): registering again", socket)
		server.Stop()
	}
}
